#!/usr/bin/env bash
# By hand, on a lent GPU machine: the CUDA tests and the GPU benchmarks in one call.
#   ../shared/tools/gpu-prep           # here, once: wheels into the git-ignored .gpu/
#   run (carry [".gpu"]): source .gpu/setup.sh && bash benchmarks/gpu_checks.sh tests small large offload
# Phases (any order, any subset):
#   tests    pytest -m cuda (the tests that need a device)
#   small    step_time --device cuda, GPT 16 x 768 (113M), zero3 vs DDP, FSDP2, DeepSpeed, alternated
#   large    the same at 20 x 2304 (1.27B)
#   zoffload ZeRO-Offload (offload_optimizer: cpu) at 113M, zero3 vs FSDP2 and DeepSpeed's
#   profile  --breakdown of zero3 and DDP at 113M (torch.profiler: where the step goes)
#   offload  gpu_offload.py at 1.27B, plain pinned allocation and registered pages
#   hf       the Trainer example on CUDA (torchrun, 1 GPU: nccl), resumed; hf_trainer.py, zero3 vs DDP,
#            FSDP2 (accelerate's own) and DeepSpeed
# Logs and JSON go to $OUT (or /tmp/gpu_checks) when set.
set -uo pipefail
out=${OUT:-/tmp/gpu_checks}
mkdir -p "$out"
export TORCH_CUDA_ARCH_LIST=9.0  # the image sets "9.0a", which DeepSpeed's JIT parser refuses
engines=${ENGINES:-ddp,zero3,fsdp2,deepspeed}
python3 -c "import deepspeed" 2>/dev/null || engines=${engines/,deepspeed/}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
seq=(--block-size 1024 --micro-batch 8 --nproc 1 --device cuda)
for phase in "$@"; do
  echo "=== $phase"
  case $phase in
    tests)
      python3 -m pytest -q -p no:cacheprovider -m cuda -rs tests 2>&1 | tee "$out/tests.log" | tail -25 ;;
    small)
      python3 benchmarks/step_time.py --engines "$engines" --n-layer 16 --n-embd 768 --n-head 12 "${seq[@]}" \
        --steps ${STEPS:-20} --warmup 3 --rounds ${ROUNDS:-3} --out "$out/step_small.json" 2>&1 | tee "$out/small.log" | tail -30 ;;
    large)
      python3 benchmarks/step_time.py --engines "$engines" --n-layer 20 --n-embd 2304 --n-head 18 "${seq[@]}" \
        --steps ${STEPS:-10} --warmup 2 --rounds ${ROUNDS:-2} --out "$out/step_large.json" 2>&1 | tee "$out/large.log" | tail -30 ;;
    zoffload)
      python3 benchmarks/step_time.py --engines "${engines/ddp,/}" --offload-optimizer cpu --n-layer 16 --n-embd 768 --n-head 12 \
        "${seq[@]}" --steps 10 --warmup 2 --rounds ${ROUNDS:-2} --out "$out/step_zoffload.json" 2>&1 | tee "$out/zoffload.log" | tail -20 ;;
    profile)
      python3 benchmarks/step_time.py --engines zero3,ddp --n-layer 16 --n-embd 768 --n-head 12 "${seq[@]}" \
        --steps 10 --warmup 3 --trace "$out" --profile --out "$out/step_profile.json" 2>&1 | tee "$out/profile.log" | tail -12
      cp benchmarks/results/*.prof "$out/" 2>/dev/null
      python3 -c "import pstats,glob; [pstats.Stats(f).sort_stats('tottime').print_stats(30) for f in glob.glob('$out/*.prof')]" > "$out/cprofile.txt" 2>&1
      head -3 "$out"/*_trace.txt ;;
    offload)
      python3 benchmarks/gpu_offload.py --out "$out/offload_plain.json" 2>&1 | tail -8
      PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8 \
        python3 benchmarks/gpu_offload.py --out "$out/offload_registered.json" 2>&1 | tail -8 ;;
    hf)
      torchrun --standalone --nproc_per_node 1 examples/hf_trainer.py --out "$out/hf-run" --steps 20 --bf16 2>&1 \
        | tee "$out/hf_example.log" | tail -4
      torchrun --standalone --nproc_per_node 1 examples/hf_trainer.py --out "$out/hf-run" --steps 30 --bf16 \
        --resume "$out/hf-run/checkpoint-20" 2>&1 | tee -a "$out/hf_example.log" | tail -4
      python3 benchmarks/hf_trainer.py --world 1 --rounds ${ROUNDS:-2} --engines "$engines" --hidden 1024 --layers 8 \
        --out "$out/hf_trainer.json" 2>&1 | tee "$out/hf_trainer.log" | tail -12 ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
