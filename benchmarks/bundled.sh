#!/usr/bin/env bash
# Benchmarks every bundled pair (models/, `make models`) on ONNX Runtime CPU against its target-only artifact
# and the peers; figures go to docs/bench/<pair>.{json,png}. Usage: benchmarks/bundled.sh [pair ...]
# (pairs: llama3-dflash llama3-eagle3 deepseek-v3-mtp deepseek-v3-eagle3 gemma4-mtp). Engines interleaved, 1 intra-op thread; PEERS=transformers,ort-genai adds transformers (slow).
set -euo pipefail
cd "$(dirname "$0")/.."
UNISPEC=${UNISPEC:-.venv/bin/unispec}
ART=${ART:-artifacts/bench}
OUT=${OUT:-docs/bench}
BENCH_ARGS=${BENCH_ARGS:-"--batch-sizes 1,4,16 --temperature 0,0.7 --top-p 0.95 --repeats 16 --max-tokens 64 --threads 1"}
mkdir -p "$ART" "$OUT"

export_once() {  # name target draft method k
  [ -f "$ART/$1/manifest.json" ] || $UNISPEC export --target "models/$2" ${3:+--draft "models/$3"} --method "$4" \
    --num-speculative-tokens "$5" --out "$ART/$1" > /dev/null
}

bench() {  # pair target draft method k [peers]
  export_once "$1" "$2" "$3" "$4" "$5"
  export_once "$2-none" "$2" "" none 0
  $UNISPEC bench "$ART/$1" --baseline "$ART/$2-none" $BENCH_ARGS --peers "${PEERS:-${6:-ort-genai}}" \
    --json "$OUT/$1.json" --plot "$OUT/$1.png" | tee "$OUT/$1.txt"
}

pairs=("$@")
[ ${#pairs[@]} -gt 0 ] || pairs=(llama3-dflash llama3-eagle3 deepseek-v3-mtp deepseek-v3-eagle3 gemma4-mtp)
for pair in "${pairs[@]}"; do
  case $pair in
    llama3-dflash) bench llama3-dflash llama3 llama3-dflash dflash 7 ;;
    llama3-eagle3) bench llama3-eagle3 llama3 llama3-eagle3 eagle3 3 ;;
    deepseek-v3-mtp) bench deepseek-v3-mtp deepseek-v3 "" mtp 3 ;;
    deepseek-v3-eagle3) bench deepseek-v3-eagle3 deepseek-v3 deepseek-v3-eagle3-mla eagle3 3 ;;
    gemma4-mtp) bench gemma4-mtp gemma4 gemma4-assistant gemma4-mtp 3 ;;
    *) echo "unknown pair $pair" >&2; exit 2 ;;
  esac
done
