#!/usr/bin/env bash
# Tokenisation speed of tools/make_shards against the Python `tokenizers` library's encode_batch on
# a synthesised JSONL corpus of at least GB gigabytes of text (KJV documents with variations, made
# by bench/peer_tokenize.py and kept in WORK for later runs). make_shards uses all cores (the whole
# process is timed, with its peak memory); the peer's encode_batch calls are timed alone. The ids
# are compared document by document; prints one JSON line (exit 1 when the ids differ).
# usage: bench/make_shards_bench.sh TOKENIZER_JSON [GB=1.0] [WORK=/tmp/make_shards_bench]
#        BUILD=build by default. The peer needs python3 with `tokenizers`; without network access,
#        WHEELS=DIR with a tokenizers wheel (`pip download tokenizers --no-deps -d DIR` elsewhere)
#        unpacks it under WORK and puts it on PYTHONPATH (no pip needed).
set -euo pipefail
cd "$(dirname "$0")/.."
tokenizer=${1:?usage: bench/make_shards_bench.sh TOKENIZER_JSON [GB] [WORK]}
gb=${2:-1.0}
work=${3:-/tmp/make_shards_bench}
build=${BUILD:-build}
[ -x "$build/tools/make_shards" ] || { echo "make_shards_bench: $build/tools/make_shards is missing (BUILD=...)"; exit 1; }
mkdir -p "$work"
if ! python3 -c "import tokenizers" 2>/dev/null && [ -n "${WHEELS:-}" ]; then
  for wheel in "$WHEELS"/*.whl; do python3 -m zipfile -e "$wheel" "$work/pydeps"; done
  export PYTHONPATH=$work/pydeps${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import tokenizers" 2>/dev/null || { echo "make_shards_bench: python3 needs 'pip install tokenizers' (or WHEELS=DIR)"; exit 1; }
export TOKENIZERS_PARALLELISM=true
corpus=$work/corpus_${gb}gb.jsonl
if [ ! -s "$corpus" ]; then
  python3 bench/peer_tokenize.py corpus --kjv data/kjv.txt.gz --gb "$gb" --out "$corpus"
fi
python3 bench/peer_tokenize.py run --make-shards "$build/tools/make_shards" --tokenizer "$tokenizer" \
  --corpus "$corpus" --shard "$work/corpus.tok" --threads "$(nproc)"
