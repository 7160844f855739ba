#!/usr/bin/env bash
# The files battery 30 runs on (benchmarks/battery-30.md): `R=/path/to/repo bash files.sh` in an empty folder.
set -e
R=${R:?set R to the repository}
T=$R/tests/configs
head -c 2000 /dev/urandom > bin.json
printf "base_model: $T/llama-tiny.json\nsequence_len: 32\nmicro_batch_size: 2\n" > ax_ok.yml
printf "base_model: $T/llama-tiny.json\nsequence_len: 32\nmicro_batch_size: 2\ndeepspeed: bin.json\n" > ax_inc_bin.yml
printf "model_name_or_path: $T/llama-tiny.json\nstage: dpo\nfinetuning_type: lora\nlora_rank: 8\ncutoff_len: 32\nper_device_train_batch_size: 2\n" > lf_dpo.yaml
echo '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}' > ds_z3.json
cfg() { printf "model: hf:$T/%s\ngpu: 24GB\nseq: 32\n%s\n" "$2" "$3" > $1; }
cfg c_grpo_ok.yaml llama-tiny.json $'preference: grpo\ngenerations: 2\ncompletion_len: 8\nbatch: 2'
cfg c_grpo_gen_float.yaml llama-tiny.json $'preference: grpo\ngenerations: 2.5\nbatch: 4'
cfg c_kto_b1.yaml llama-tiny.json $'preference: kto\nbatch: 1'
cfg c_gen_nopref.yaml llama-tiny.json $'generations: 2'
cfg c_rollout_bad.yaml llama-tiny.json $'preference: grpo\ngenerations: 2\nbatch: 2\nrollout: sglang'
cfg c_vl_ok.yaml qwen2.5-vl-tiny.json $'images: 1\nimage_size: 448x448'
cfg c_vl_list.yaml qwen2.5-vl-tiny.json $'images: 1\nimage_size: [448, 448]'
cfg c_chunk_ok.yaml llama-tiny.json $'loss_head: chunked-output:4'
cfg c_chunk_0.yaml llama-tiny.json $'loss_head: chunked-output:0'
cfg c_lora_base.yaml llama-tiny.json $'lora: {r: 4, dtype: base}'
cfg c_lora_dtype5.yaml llama-tiny.json $'lora: {r: 4, dtype: 5}'
cfg c_reentrant.yaml llama-tiny.json $'checkpointing: blocks-reentrant'
cfg c_reentrant_us.yaml llama-tiny.json $'checkpointing: blocks_reentrant'
cfg c_orpo_ref.yaml llama-tiny.json $'preference: orpo\nreference: copy'
printf "from: ax_ok.yml\ngpu: 24GB\npreference: orpo\n" > c_from_orpo.yaml
