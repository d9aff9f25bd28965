#!/usr/bin/env bash
# By hand, on a lent GPU machine: the CUDA tests and the GPU benchmarks in one call.
#   ../shared/tools/gpu-prep           # here, once: wheels into the git-ignored .gpu/
#   run (carry [".gpu"]): source .gpu/setup.sh && bash benchmarks/gpu_checks.sh tests small large peakmem offload
#   (setup.sh also builds DeepSpeed from its sdist; installing only .gpu/whl/*.whl into /tmp/site and putting
#   it and the checkout on PYTHONPATH is enough without DS=1)
# Phases (any order, any subset), each under its own time limit (seconds: LIMIT_<phase>=N), so one
# that hangs or runs long leaves the later ones their time:
#   tests    pytest -m cuda (every test that runs on a device), on XDIST workers (default 8) when
#            pytest-xdist is there
#   small    step_time --device cuda, GPT 16 x 768 (113M), zero3 vs DDP, FSDP2 (and DeepSpeed), alternated,
#            then one torch.profiler run per engine (--breakdown: where the step goes)
#   large    the same at 20 x 2304 (1.27B), with zero3-lean (lean_memory) too, without the profiler run
#   zoffload ZeRO-Offload (offload_optimizer: cpu) at 113M, zero3 (after the backward, and overlapped with
#            it: super_offload) vs DeepSpeed's
#   profile  a torch.profiler trace of zero3 and DDP at 113M (the top ops, per engine)
#   peakmem  the allocations alive at the device memory's peak, by allocating code, zero3 (and lean) vs FSDP2 at 1.27B
#   offload  gpu_offload.py at 1.27B, pinned ahead (engine.pin_offload_buffers) while 30 steps train:
#            with the allocator's pinned allocation, then with registered pages
#   hf       the Trainer example on CUDA (torchrun, 1 GPU: nccl), resumed; hf_trainer.py, zero3 vs DDP,
#            FSDP2 (accelerate's own) and DeepSpeed
#   quantize ZeRO++'s block quantize / dequantize throughput beside a device copy's (goal: half of it)
#   ckptcpu  issue 39's every-step async checkpoint overhead (6 x 512 GPT, 2 CPU ranks: checkpoint.py
#            --overhead) on a host with cores to spare for the writer and the disk (on the 2-core CI
#            machine both cores train, and 228 MB a step costs CPU they do not have: docs/benchmarks.md)
# ENGINES picks the step_time engines (default ddp,zero3,fsdp2, plus deepspeed when it imports and DS=1:
# its fused Adam is compiled on first use, which costs a minute of device time).
# The log goes to $OUT/all.log (or /tmp/gpu_checks) and, after every phase, the JSON results and
# per-phase logs to $OUT/results.tgz: the device tool brings back few files.
set -uo pipefail
out=${OUT:-/tmp/gpu_checks}
work=/tmp/gpu_checks_work
mkdir -p "$out" "$work"
exec > >(tee -a "$out/all.log") 2>&1
export TORCH_CUDA_ARCH_LIST=9.0  # the image sets "9.0a", which DeepSpeed's JIT parser refuses
engines=${ENGINES:-ddp,zero3,fsdp2}
if [[ ${DS:-0} == 1 ]] && python3 -c "import deepspeed" 2>/dev/null; then engines=${ENGINES:-ddp,zero3,fsdp2,deepspeed}; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'engines: $engines')"
seq=(--block-size 1024 --micro-batch 8 --nproc 1 --device cuda)
limit() { local name="LIMIT_$1"; echo "${!name:-$2}"; }
pack() { tar czf "$out/results.tgz.part" -C "$work" . && mv "$out/results.tgz.part" "$out/results.tgz"; }
start=$SECONDS
for phase in "$@"; do
  echo "=== $phase (at ${SECONDS}s)"
  case $phase in
    tests)
      workers=()
      python3 -c "import xdist" 2>/dev/null && workers=(-n "${XDIST:-8}")
      # torchft (a Rust extension) is not in the GPU image; its tests run on gloo only, none is marked cuda
      python3 -c "import torchft" 2>/dev/null || { workers+=(--ignore tests/test_fault_tolerance.py); echo "no torchft: tests/test_fault_tolerance.py (CPU only) not collected"; }
      timeout "$(limit tests 150)" python3 -m pytest -q -p no:cacheprovider -m cuda -rfEs --timeout 100 --continue-on-collection-errors "${workers[@]}" \
        --junitxml "$work/tests.xml" tests > "$work/tests.log" 2>&1
      echo "rc $?"; tail -40 "$work/tests.log" ;;
    small)
      timeout "$(limit small 140)" python3 benchmarks/step_time.py --engines "$engines" --n-layer 16 --n-embd 768 \
        --n-head 12 "${seq[@]}" --steps "${STEPS:-20}" --warmup 3 --rounds "${ROUNDS:-3}" --breakdown \
        --out "$work/step_small.json" > "$work/small.log" 2>&1
      echo "rc $?"; tail -30 "$work/small.log" ;;
    large)
      # zero3-lean beside them: lean_memory's peak against FSDP2's is issue 43's item 1
      timeout "$(limit large 150)" python3 benchmarks/step_time.py --engines "${LARGE_ENGINES:-$engines,zero3-lean}" --n-layer 20 --n-embd 2304 \
        --n-head 18 "${seq[@]}" --steps "${STEPS_LARGE:-10}" --warmup 2 --rounds "${ROUNDS_LARGE:-2}" \
        --out "$work/step_large.json" > "$work/large.log" 2>&1
      echo "rc $?"; tail -30 "$work/large.log" ;;
    zoffload)
      timeout "$(limit zoffload 120)" python3 benchmarks/step_time.py --engines "${ZENGINES:-zero3,zero3-overlap,deepspeed}" \
        --offload-optimizer cpu --n-layer 16 --n-embd 768 --n-head 12 "${seq[@]}" --steps 10 --warmup 2 \
        --rounds "${ROUNDS_LARGE:-2}" --out "$work/step_zoffload.json" > "$work/zoffload.log" 2>&1
      echo "rc $?"; tail -20 "$work/zoffload.log" ;;
    profile)
      timeout "$(limit profile 120)" python3 benchmarks/step_time.py --engines zero3,ddp --n-layer 16 --n-embd 768 \
        --n-head 12 "${seq[@]}" --steps 10 --warmup 3 --trace "$work" --out "$work/step_profile.json" \
        > "$work/profile.log" 2>&1
      echo "rc $?"; tail -12 "$work/profile.log"; head -25 "$work"/*_trace.txt ;;
    peakmem)
      # Where the device memory goes at its peak (1.27B, zero3 vs FSDP2): allocations alive at the highest
      # point, by the code that made them (<engine>_peak_memory.txt).
      timeout "$(limit peakmem 150)" python3 benchmarks/step_time.py --engines zero3,zero3-lean,fsdp2 --n-layer 20 \
        --n-embd 2304 --n-head 18 "${seq[@]}" --steps 3 --warmup 2 --trace "$work" \
        --out "$work/step_peakmem.json" > "$work/peakmem.log" 2>&1
      echo "rc $?"; tail -8 "$work/peakmem.log"; cat "$work"/*_peak_memory.txt ;;
    offload)
      # The first offload's cost is page-locking the host buffers: pinned ahead in the background (the
      # steps train meanwhile), with the allocator's pinned allocation, then with registered pages.
      for how in allocated registered; do
        conf=()
        [[ $how == registered ]] && conf=(PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:${REGISTER_THREADS:-16})
        env "${conf[@]}" timeout "$(limit offload 60)" python3 benchmarks/gpu_offload.py --pin-ahead \
          --steps 30 --cycles 2 --out "$work/offload_$how.json" > "$work/offload_$how.log" 2>&1
        echo "rc $?"; tail -8 "$work/offload_$how.log"
      done ;;
    hf)
      timeout "$(limit hf 240)" bash -c "
        torchrun --standalone --nproc_per_node 1 examples/hf_trainer.py --out $work/hf-run --steps 20 --bf16 &&
        torchrun --standalone --nproc_per_node 1 examples/hf_trainer.py --out $work/hf-run --steps 30 --bf16 \
          --resume $work/hf-run/checkpoint-20 &&
        python3 benchmarks/hf_trainer.py --world 1 --rounds ${ROUNDS:-2} --engines ${engines} --hidden 1024 \
          --layers 8 --out $work/hf_trainer.json" > "$work/hf.log" 2>&1
      echo "rc $?"; tail -16 "$work/hf.log"; rm -rf "$work/hf-run" ;;
    quantize)
      timeout "$(limit quantize 60)" python3 benchmarks/quantize_throughput.py --device cuda \
        --json "$work/quantize_cuda.json" > "$work/quantize.log" 2>&1
      echo "rc $?"; tail -8 "$work/quantize.log" ;;
    ckptcpu)
      timeout "$(limit ckptcpu 240)" python3 benchmarks/checkpoint.py --overhead --rounds "${ROUNDS:-2}" --steps 10 \
        --out "$work/ckpt_overhead_cpu.json" > "$work/ckptcpu.log" 2>&1
      echo "rc $?"; tail -14 "$work/ckptcpu.log" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
  pack
done
echo "=== done in $((SECONDS - start))s"
