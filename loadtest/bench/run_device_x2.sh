#!/usr/bin/env bash
# One run on a host with two H200s that measures what needs two GPUs, each part bounded so one
# stuck part cannot eat the others' time. Needs, in the working tree, .whl/ (wheels of what the
# GPU machine lacks, xgrammar among them, and .deb files under .whl/deb) and .tok (the default
# model's tokenizer files); results land in $OUT (default /tmp/out), a short table per part.
#   bash loadtest/bench/run_device_x2.sh                       # every part (longer than 600 s)
#   PARTS=tp_moe,tp_dense,stack_dense bash loadtest/bench/run_device_x2.sh   # some of them
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
for f in .whl/deb/*.deb; do dpkg -x "$f" /tmp/r; done
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/r/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/r/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
PARTS=${PARTS:-allreduce,tp_moe,tp_dense,tp_fp8,moe_split,hetero_tp,stack_dense}
part() {  # part NAME SECONDS CMD...: run bounded, log to $OUT/NAME.log, print its table
  local name=$1 secs=$2; shift 2
  case ",$PARTS," in *",$name,"*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "##### $name: rc=$rc in $((SECONDS - t0))s"
  sed -n '/^=== /,$p' "$OUT/$name.log" | tail -40
  [ $rc -eq 0 ] || tail -5 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# TP=2 and EP=2 against TP=1 (greedy, fp32 dense and MoE; bf16 MoE) and the MoE decode steps
part tp_moe "${T_TP_MOE:-175}" python3 -m loadtest.bench --suite tp --sections ceilings,tp_equality,moe_tp \
  --moe-tp-layouts 2/1,2/2 --moe-tp-batches 1,64 --steps 16 --json "$OUT/tp_moe.json"
# the all-reduce alone: our one-launch fused kernel, the barrier version, torch's one-shot, NCCL
part allreduce "${T_AR:-90}" python3 -m loadtest.bench --suite tp --sections allreduce --json "$OUT/allreduce.json"
# dense decode step (Qwen3-8B shape): TP=1 against TP=2 with the fused all-reduce, overlap on and off;
# uninstrumented (the profile's follower syncs stall an overlapped pipeline: its rows are not step times)
part tp_dense "${T_TP_DENSE:-330}" python3 -m loadtest.bench.tp_profile --batches 1,32 --steps 24 --no-instrument \
  --configs "${TP_CONFIGS:-1:off:fused:overlap,2:on:fused:overlap,2:on:fused}" --timeout 105
# FP8 under TP=2: greedy tokens against TP=1 (FP8 weights, and with FP8 KV), the 8B FP8 decode step
part tp_fp8 "${T_TP_FP8:-300}" python3 -m loadtest.bench --suite tp --sections ceilings,tp_fp8,tp_fp8_steps --tp-batches 1,32 \
  --steps 24 --json "$OUT/tp_fp8.json"
# a MoE checkpoint served disaggregated: prefill on GPU 0, decode on GPU 1
part moe_split "${T_MOE_SPLIT:-100}" python3 -m loadtest.bench.stack_gpu --model qwen3-30b-a3b --stacks split \
  --concurrency 4,16 --input-len 1024 --output-len 128 --warmup-concurrency 4 --warmup-requests 8 \
  --no-engine-steps --tokenizer-from .tok --out "$OUT/moe_split"
# prefill TP=2 over both GPUs, decode TP=1 sharing GPU 0 (KV re-sharded by heads), vs 1 -> 1
part hetero_tp "${T_HETERO:-300}" python3 -m loadtest.bench.hetero_tp --tokenizer-from .tok \
  --prompt-lens 4096,16384 --layouts "2->1,1->1" --out "$OUT/hetero_tp"
# the whole stack against the engine's step: 1 prefill + 1 decode (STACKS=split,colocated2 to
# compare with two colocated workers when the time allows)
part stack_dense "${T_STACK:-80}" python3 -m loadtest.bench.stack_gpu --model qwen3-8b --stacks "${STACKS:-split}" \
  --concurrency 32 --input-len 1024 --output-len 256 --warmup-requests 16 --tokenizer-from .tok \
  --out "$OUT/stack_dense"
