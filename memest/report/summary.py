"""The estimate's summary as one ordered list of rows, which the console (console.py) and Markdown
(markdown.py) both render: the run, parameters, the peak and its breakdown, the parallel layout, host
memory, the device's fixed costs, the rule of thumb, the time traced and the notes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from memest.report.analysis import BREAKDOWN_KEYS, Report
from memest.units import format_bound, format_bytes, format_count


class RowKind(Enum):
    TEXT = "text"  # label: value detail
    HEADLINE = "headline"  # a figure shown in bold (peak allocated, needed)
    PART = "part"  # one category of what is alive at the peak: value bytes, detail its share
    NOTE = "note"  # a note under the summary


@dataclass(frozen=True)
class SummaryRow:
    label: str  # "" continues the row above
    value: str  # the figure, or the row's text
    detail: str = ""  # what qualifies the value, written after it with one space
    kind: RowKind = RowKind.TEXT
    code: tuple[tuple[int, int], ...] = ()  # (start, end) of module and op names in ``text`` (Markdown: code)

    @property
    def text(self) -> str:
        return f"{self.value} {self.detail}" if self.detail else self.value


def summary_rows(report: Report) -> list[SummaryRow]:
    """Every row of the estimate's summary, in the order shown."""
    return [
        *_run_rows(report),
        SummaryRow("parameters", format_count(report.param_count), f"({format_bytes(report.param_bytes)})"),
        *_peak_rows(report),
        *_device_rows(report),
        _folklore_row(report),
        SummaryRow("traced in", f"{report.trace_seconds:.2f} s"),
        *(SummaryRow("note", note, kind=RowKind.NOTE) for note in report.notes),
    ]


def _run_rows(report: Report) -> list[SummaryRow]:
    """What was traced: batch and precision, attention kernels, accumulation, checkpointing, parallel layout."""
    spec = report.spec
    run = (f"batch {spec['batch']}" + (f", seq {spec['seq']}" if spec.get("seq") else "")
           + f", {spec['optim']}, {spec['precision']}, target {spec['target']}, {spec['iterations']} steps traced")
    rows = [SummaryRow("run", run)]
    if report.attention_backends:
        used = ", ".join(f"{name} x{n}" for name, n in report.attention_backends.items())
        cc = spec.get("compute_capability") or ()
        rows.append(SummaryRow("attention", used, f"(CUDA kernel rules for sm{''.join(str(x) for x in cc)})"))
    if spec.get("grad_accum", 1) > 1:
        rows.append(SummaryRow("accumulation", f"{spec['grad_accum']} micro-steps of batch {spec['batch']}: "
                                               f"effective batch {report.effective_batch}"))
    if report.checkpointed:
        rows.append(_checkpointing_row(report))
    if report.activation_host:
        host = report.activation_host
        kind = "pinned" if host["pinned"] else "pageable"
        rows.append(SummaryRow("activation offload", f"{format_bytes(host['host_peak_bytes'])} {kind} host memory",
                               f"at its peak ({host['mode']}: saved tensors copied to the host, not in the device peak; "
                               f"rules: {host['rules']})"))
    return rows + _images_rows(report) + _parallel_rows(report)


def _images_rows(report: Report) -> list[SummaryRow]:
    """--images: the tokens the processor makes of them, and the vision tower's part of the peak."""
    im = report.images
    if not im:
        return []
    cut = (f"{im['per_example']} x {im['size']} per example -> {im['resized']}, {im['tokens_per_image']} tokens each; "
           f"{im['image_tokens']} image tokens in the batch")
    rows = [SummaryRow("images", cut, f"({im['processor']})")] if im["per_example"] else []
    if video := im.get("video"):
        t = video["grid_thw"][0]
        rows.append(SummaryRow("video", f"{video['frames']} frames of {video['size']} per example -> {video['resized']}, "
                               f"{t} temporal patches, {video['tokens_per_video']} tokens each; {im['video_tokens']} "
                               "video tokens in the batch", f"({video['processor']})"))
    tower = ", ".join(im["tower"])
    state = im["tower_state"] + (f" ({format_bytes(im['tower_gradient_bytes'])} of gradients)"
                                 if im["tower_state"] == "partly trained" else "")
    cost = (f"{format_count(im['tower_params'])} params ({format_bytes(im['tower_param_bytes'])}), {state}; "
            f"at the peak {format_bytes(im['tower_bytes_at_peak'])} ({100 * im['tower_share_of_peak']:.1f}%), "
            f"activations {format_bytes(im['tower_activation_bytes_at_peak'])} "
            f"({100 * im['tower_share_of_activations']:.1f}% of those at the peak)")
    text, code = _coded("vision tower ", tower, f": {cost}")
    return [*rows, SummaryRow("", text, code=code)]


def _checkpointing_row(report: Report) -> SummaryRow:
    """The modules checkpointed (the first three named) and what recomputing them costs."""
    base = report.step_flops - report.recompute_flops
    pct = 100 * report.recompute_flops / base if base else 0.0
    value, shown = f"{len(report.checkpointed)} modules", report.checkpointed[:3]
    more = f", … (+{len(report.checkpointed) - 3})" if len(report.checkpointed) > 3 else ""
    parts = [f"{value} ("]
    for i, name in enumerate(shown):
        parts += [name, ", " if i < len(shown) - 1 else f"{more}); recompute costs {pct:.1f}% extra FLOPs per step"]
    text, code = _coded(*parts)
    return SummaryRow("checkpointing", value, text[len(value) + 1:], code=code)


def _parallel_rows(report: Report) -> list[SummaryRow]:
    """--world-size / --shard / --offload: the rank traced and its layout, and what was offloaded to the host."""
    sh = report.sharding
    if not sh:
        return []
    label = "parallel" if max(report.spec.get(k, 1) for k in ("tp", "pp", "ep", "cp")) > 1 else "data parallel"
    rows = [SummaryRow(label, f"rank {sh.get('rank', 0)} of {sh['world_size']}"
                       + (f", {sh['parallel']}" if sh.get("parallel") else "")
                       + f"; effective batch {report.effective_batch}")]
    if sh.get("host_peak_bytes"):
        rows.append(SummaryRow("host memory", format_bytes(sh["host_peak_bytes"]),
                               "peak offloaded to the CPU (not in the GPU peak)"))
    return rows


def _peak_rows(report: Report) -> list[SummaryRow]:
    """The peak, where it happens and what is alive at it, by category."""
    peak = report.peak_allocated_bytes
    where = f"step {report.peak_iteration}, {report.phase_at_peak}" + (", in " if report.module_at_peak else "")
    text, code = _coded(where, report.module_at_peak, ", op ", report.op_at_peak)
    rows = [SummaryRow("peak allocated", format_bytes(peak), kind=RowKind.HEADLINE),
            SummaryRow("peak happens", text, code=code)]
    for key in BREAKDOWN_KEYS:
        value = report.breakdown_at_peak.get(key, 0)
        label = "other (buffers, inputs)" if key == "other" else key.replace("_", " ")
        rows.append(SummaryRow(label, format_bytes(value), f"{100 * value / peak if peak else 0:5.1f}%", RowKind.PART))
    return rows


def _device_rows(report: Report) -> list[SummaryRow]:
    """--target cuda: what torch would report, the fixed costs outside the allocator, device use and the need."""
    dev = report.device
    if dev is None:
        return []
    rows = [SummaryRow("torch would report", f"max_memory_allocated {format_bytes(dev.allocated_peak_bytes)}",
                       "(+ cuBLAS workspaces, 512 B blocks)"),
            SummaryRow("", f"max_memory_reserved {format_bytes(dev.reserved_peak_bytes)}", "(caching-allocator replay)")]
    for cost in dev.fixed_costs:
        if not cost.in_allocator:
            tag = "calibrated" if cost.calibrated else "assumption" if cost.source.startswith("assumption") else "evidence"
            spread = f", {format_bytes(cost.low)}-{format_bytes(cost.high)}" if cost.low != cost.high else ""
            count = f"; {dev.nccl_communicators} communicator(s)" if cost.name == "nccl_communicator" else ""
            rows.append(SummaryRow("", f"+ {cost.name.replace('_', ' ')} {format_bytes(cost.bytes)}",
                                   f"({tag}{spread}{count})"))
    rows.append(SummaryRow("predicted device use", format_bytes(dev.device_bytes),
                           f"(range {format_bytes(dev.bytes_low)} - {format_bound(dev.bytes_high)}; what nvidia-smi would "
                           "show for the process on a GPU with room to spare)"))
    if dev.device_used_bytes_expected:
        rows.append(SummaryRow("", f"device-wide used {format_bytes(dev.device_used_bytes_expected)}",
                               f"(range {format_bytes(dev.device_used_bytes_low)} - "
                               f"{format_bound(dev.device_used_bytes_high)}; + the driver's reservation outside any "
                               f"process, {format_bytes(dev.device_reservation_bytes_low)}-"
                               f"{format_bytes(dev.device_reservation_bytes_high)}: NVML device used, vs a card's total)"))
    rows.append(SummaryRow("needed", format_bytes(dev.min_budget_bytes),
                           f"(range {format_bytes(dev.needed_bytes_low)} - {format_bound(dev.needed_bytes_high)}; the "
                           "smallest device budget the step runs in: the allocator frees its cache before running out)",
                           RowKind.HEADLINE))
    return rows


def _folklore_row(report: Report) -> SummaryRow:
    if report.folklore_skipped:  # the rule of thumb does not apply here: no figure, the reason
        return SummaryRow("folklore formula", "not applicable", f"({report.folklore_skipped})")
    peak = report.peak_allocated_bytes
    rel = (report.folklore_bytes - peak) / peak if peak else 0
    return SummaryRow("folklore formula", format_bytes(report.folklore_bytes),
                      f"({report.folklore_formula}): {100 * rel:+.0f}% vs the trace")


def _coded(*parts: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """``parts`` joined, every second one a name (module, op): the text and the names' (start, end)."""
    text, code = "", []
    for i, part in enumerate(parts):
        if i % 2 and part:
            code.append((len(text), len(text) + len(part)))
        text += part
    return text, tuple(code)
