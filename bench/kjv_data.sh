# Sourced by the bench scripts: kjv_shards DATA_DIR makes DATA_DIR/kjv_train.bin and kjv_val.bin,
# byte-level shards of the bundled King James Bible with 5% held out (the quickstart's layout),
# unless both are there already. Needs build/tools/make_shards; run from the repository root.
kjv_shards() {
  mkdir -p "$1"
  if [ ! -f "$1/kjv_train.bin" ] || [ ! -f "$1/kjv_val.bin" ]; then
    gunzip -c data/kjv.txt.gz > "$1/kjv.txt"
    build/tools/make_shards "$1/kjv.txt" --tokenizer byte --val-fraction 0.05 \
      --train-out "$1/kjv_train.bin" --val-out "$1/kjv_val.bin"
  fi
}
