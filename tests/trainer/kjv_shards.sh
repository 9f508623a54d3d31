# Sourced by the end-to-end scripts: make_kjv_shards SOURCE_DIR BUILD_DIR WORK BYTES writes
# WORK/train.bin and WORK/val.bin, byte-level shards of the first BYTES of the bundled corpus.
make_kjv_shards() {
  gunzip -c "$1/data/kjv.txt.gz" > "$3/all.txt"
  head -c "$4" "$3/all.txt" > "$3/kjv.txt"
  "$2/tools/make_shards" "$3/kjv.txt" --tokenizer byte --val-fraction 0.05 \
    --train-out "$3/train.bin" --val-out "$3/val.bin" > /dev/null
}
