#!/bin/sh
# docs/PERFORMANCE.md, "GGUF pairs on the CPU": a Qwen3-VL-2B-shaped random checkpoint as a
# llama-quantize Q4_K_M pair, as our q4_0 GGUF pair and as bf16 safetensors quantized to q4_0 on
# load; `kvlens generate --json` on each, twice, alternating, with peak RSS and wall time.
#
#   LLAMA_QUANTIZE=path/to/llama-quantize tools/gguf/measure_q4_k_m.sh [WORK_DIR]
#
# llama-quantize: cmake -B build -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF && cmake --build build
# --target llama-quantize, in the llama-cpp-python sdist's vendor/llama.cpp (cmake from PyPI).
set -e
K=${KVLENS:-$HOME/.cache/kvlens/target/release/kvlens}
WORK=${1:-/tmp/kvlens-q4km}
mkdir -p "$WORK" && cd "$WORK"
[ -d ckpt ] || $K random-checkpoint --config Qwen3-VL-2B-Instruct --out ckpt --dtype bf16 --seed 0 --force
[ -d f16 ] || $K to-gguf --model ckpt --outtype f16 --out f16
[ -d q4_0 ] || $K to-gguf --model ckpt --outtype q4_0 --out q4_0
if [ ! -d q4km ]; then
  mkdir q4km && "$LLAMA_QUANTIZE" f16/ckpt-F16.gguf q4km/ckpt-Q4_K_M.gguf Q4_K_M > q4km.log 2>&1
  cp f16/mmproj-ckpt-F16.gguf q4km/
fi
run() {
  label=$1; shift
  /usr/bin/time -v $K generate "$@" --prompt "Describe a cat in detail." --max-tokens 32 --ignore-eos --json \
    > out-$label.json 2> time-$label.txt
  python3 - "$label" <<'PY'
import json, re, sys
l = sys.argv[1]
o = json.load(open(f"out-{l}.json")); t = open(f"time-{l}.txt").read()
rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", t).group(1))
wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", t).group(1)
print(f"{l:12s} decode {o['timing']['decode_tokens_per_s']:.2f} tok/s  prefill {o['timing']['prefill_tokens_per_s']:.1f} tok/s"
      f"  ledger weights {o['weights']['bytes'] / 2**30:.3f} GiB  peak RSS {rss / 2**20:.2f} GiB  wall {wall}")
PY
}
$K bench bandwidth 2>&1 | tail -1
for i in 1 2; do
  run q4km-$i --model q4km/ckpt-Q4_K_M.gguf --mmproj q4km/mmproj-ckpt-F16.gguf
  run q4_0load-$i --model ckpt --quantization q4_0
  run q4_0gguf-$i --model q4_0/ckpt-Q4_0.gguf --mmproj q4_0/mmproj-ckpt-Q4_0.gguf
done
$K plan --model q4km/ckpt-Q4_K_M.gguf --mmproj q4km/mmproj-ckpt-F16.gguf --device cpu --json \
  | python3 -c "import json, sys; print('plan weights_bytes', json.load(sys.stdin)['weights_bytes'])"
