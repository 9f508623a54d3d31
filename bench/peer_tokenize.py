"""Peer of tools/make_shards: the Hugging Face `tokenizers` library's encode_batch on the same
documents, with the ids compared document by document. Driven by bench/make_shards_bench.sh.

  peer_tokenize.py corpus --kjv data/kjv.txt.gz --gb 1.0 --out corpus.jsonl
      Synthesises a JSONL corpus ({"text": ...} per line) of at least --gb 1e9 bytes of text from
      KJV: documents of 20..400 consecutive verses from random places, about 3% of the verses in a
      varied form (a word's letters swapped, replaced or accented, its case changed, a number put
      in), and a header line with the document number, so the corpus is not one text repeated.
      Deterministic (--seed).
  peer_tokenize.py run --make-shards BIN --tokenizer tokenizer.json --corpus corpus.jsonl
                       --shard corpus.tok [--threads N] [--batch-docs 2000]
      Runs make_shards on the corpus with N threads (wall time and peak memory of the process),
      then encode_batch over the documents in batches (time of the encode_batch calls only, so the
      peer's JSON reading is not counted), checks that the shard is the documents' ids separated by
      <|endoftext|>, and prints one JSON line with both speeds.
"""
import argparse
import gzip
import json
import mmap
import os
import random
import resource
import subprocess
import sys
import time


def read_verses(kjv_path):
    opener = gzip.open if kjv_path.endswith(".gz") else open
    with opener(kjv_path, "rt", encoding="utf-8") as f:
        text = f.read()
    # Verses start with "  N " at a line start; keep each verse with its continuation lines.
    verses, current = [], []
    for line in text.split("\n"):
        stripped = line.lstrip()
        starts_verse = line.startswith("  ") and stripped[:1].isdigit()
        if (starts_verse or not line.strip()) and current:
            verses.append("\n".join(current))
            current = []
        if line.strip():
            current.append(line)
    if current:
        verses.append("\n".join(current))
    return verses


def vary(verse, rng):
    words = verse.split(" ")
    candidates = [i for i, w in enumerate(words) if len(w) > 3 and w.isalpha()]
    if not candidates:
        return verse + " " + str(rng.randrange(10 ** 6))
    i = rng.choice(candidates)
    w = words[i]
    kind = rng.randrange(5)
    if kind == 0:  # swap two letters
        j = rng.randrange(len(w) - 1)
        w = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    elif kind == 1:  # replace a letter
        j = rng.randrange(len(w))
        w = w[:j] + rng.choice("abcdefghijklmnopqrstuvwxyz") + w[j + 1:]
    elif kind == 2:  # accent a letter
        j = rng.randrange(len(w))
        w = w[:j] + rng.choice("\u00e9\u00e8\u00fc\u00f6\u00e5\u00f1\u00e7") + w[j + 1:]
    elif kind == 3:  # change the case
        w = w.upper() if rng.random() < 0.5 else w.swapcase()
    else:  # a number after it
        w = w + " " + str(rng.randrange(10 ** rng.randrange(1, 8)))
    words[i] = w
    return " ".join(words)


def make_corpus(args):
    rng = random.Random(args.seed)
    verses = read_verses(args.kjv)
    variants = [[vary(v, rng) for _ in range(4)] for v in verses]
    target = int(args.gb * 1e9)
    written, documents = 0, 0
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        while written < target:
            n = rng.randrange(20, 401)
            start = rng.randrange(len(verses))
            parts = [f"Document {documents} (part {rng.randrange(1000)})"]
            for k in range(start, start + n):
                k %= len(verses)
                parts.append(variants[k][rng.randrange(4)] if rng.random() < 0.03 else verses[k])
            text = "\n".join(parts) + "\n"
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            written += len(text.encode("utf-8"))
            documents += 1
    os.replace(tmp, args.out)
    print(f"corpus: {documents} documents, {written} bytes of text -> {args.out}", file=sys.stderr)


def read_documents(path, batch_docs):
    batch = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                batch.append(json.loads(line)["text"])
                if len(batch) == batch_docs:
                    yield batch
                    batch = []
    if batch:
        yield batch


def run(args):
    import tokenizers
    from tokenizers import Tokenizer

    threads = args.threads or os.cpu_count()
    # make_shards: the whole process, from loading the tokenizer to the renamed shard.
    command = [args.make_shards, args.corpus, "--jsonl-field", "text", "--tokenizer", args.tokenizer,
               "--threads", str(threads), "--train-out", args.shard]
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ours_s = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"make_shards failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    ours_rss_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2 ** 20
    sys.stderr.write(done.stdout)

    tokenizer = Tokenizer.from_file(args.tokenizer)
    separator = tokenizer.token_to_id("<|endoftext|>")
    with open(args.shard, "rb") as f:
        shard = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    header = shard[:24]
    assert header[:8] == b"LLMTOKS1", "not a token shard"
    width = int.from_bytes(header[12:16], "little")
    count = int.from_bytes(header[16:24], "little")
    ids = memoryview(shard)[24:].cast("I" if width == 4 else "H")
    assert len(ids) == count

    peer_s, text_bytes, documents, tokens, position = 0.0, 0, 0, 0, 0
    mismatch = None
    for batch in read_documents(args.corpus, args.batch_docs):
        t = time.perf_counter()
        encodings = tokenizer.encode_batch(batch, add_special_tokens=False)
        peer_s += time.perf_counter() - t
        for text, encoding in zip(batch, encodings):
            expected = encoding.ids
            if documents > 0:
                if position >= count or ids[position] != separator:
                    mismatch = mismatch or f"no separator before document {documents} (token {position})"
                position += 1
            got = ids[position:position + len(expected)].tolist()
            if got != expected and mismatch is None:
                first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
                mismatch = f"document {documents}: ids differ at its token {first} (shard token {position + first})"
            position += len(expected)
            text_bytes += len(text.encode("utf-8"))
            tokens += len(expected)
            documents += 1
    if mismatch is None and position != count:
        mismatch = f"the shard has {count} tokens, the documents and separators {position}"

    result = {
        "bench": "make_shards", "corpus_bytes": text_bytes, "documents": documents, "tokens": tokens,
        "threads": threads, "make_shards_s": round(ours_s, 3), "make_shards_mb_s": round(text_bytes / ours_s / 1e6, 1),
        "make_shards_peak_rss_gib": round(ours_rss_gib, 2),
        "peer": f"tokenizers {tokenizers.__version__} encode_batch ({args.batch_docs} documents per call)",
        "peer_encode_batch_s": round(peer_s, 3), "peer_mb_s": round(text_bytes / peer_s / 1e6, 1),
        "speedup": round(peer_s / ours_s, 2), "ids_equal": mismatch is None,
    }
    if mismatch:
        result["first_mismatch"] = mismatch
    print(json.dumps(result))
    return 0 if mismatch is None else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    corpus = sub.add_parser("corpus")
    corpus.add_argument("--kjv", required=True)
    corpus.add_argument("--gb", type=float, default=1.0)
    corpus.add_argument("--out", required=True)
    corpus.add_argument("--seed", type=int, default=1)
    r = sub.add_parser("run")
    r.add_argument("--make-shards", required=True)
    r.add_argument("--tokenizer", required=True)
    r.add_argument("--corpus", required=True)
    r.add_argument("--shard", required=True)
    r.add_argument("--threads", type=int, default=0)
    r.add_argument("--batch-docs", type=int, default=2000)
    args = parser.parse_args()
    if args.command == "corpus":
        make_corpus(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
