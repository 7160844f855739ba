#!/usr/bin/env bash
# The files battery 31 runs on (benchmarks/battery-31.md): `R=/path/to/repo bash files.sh` in an empty folder.
set -e
R=${R:?set R to the repository}
T=$R/tests/configs
printf "base_model: $T/llama-tiny.json\nsequence_len: 32\nmicro_batch_size: 2\n" > ax_ok.yml
printf "base_model: $T/llama-tiny.json\nsequence_len: 32\nmicro_batch_size: 2\ntorch_compile: true\n" > ax_compile.yml
cfg() { printf "model: hf:$T/%s\ngpu: 24GB\nseq: 32\n%s\n" "$2" "$3" > $1; }
cfg c_scope_blocks.yaml llama-tiny.json $'compile_scope: blocks'
cfg c_scope_nocompile.yaml llama-tiny.json $'compile_scope: blocks\ncompile: false'
cfg c_scope_bad.yaml llama-tiny.json $'compile_scope: layers'
cfg c_scope_caps.yaml llama-tiny.json $'compile_scope: BLOCKS'
cfg c_scope_ws2.yaml llama-tiny.json $'compile_scope: blocks\nworld_size: 2'
cfg c_grpo_ga.yaml llama-tiny.json $'preference: grpo\ngenerations: 2\ncompletion_len: 8\nbatch: 2\ngrad_accum: 2'
cfg c_grpo_gen_str.yaml llama-tiny.json $'preference: grpo\ngenerations: "2"\nbatch: 2'
cfg c_grpo_quant_nolora.yaml llama-tiny.json $'preference: grpo\ngenerations: 2\nbatch: 2\nquant: nf4'
cfg c_vl_video.yaml qwen2.5-vl-tiny.json $'video_frames: 2\nimage_size: 56x56'
cfg c_vl_video_float.yaml qwen2.5-vl-tiny.json $'video_frames: 2.5'
cfg c_vl_minmax.yaml qwen2.5-vl-tiny.json $'images: 1\nmin_pixels: 1000000\nmax_pixels: 10'
cfg c_vl_freeze.yaml qwen2.5-vl-tiny.json $'images: 1\nimage_size: 56x56\nfreeze: vision'
cfg c_vl_big.yaml qwen2.5-vl-tiny.json $'images: 1\nimage_size: 100000x100000'
