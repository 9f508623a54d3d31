#!/usr/bin/env python3
"""Builds the two evaluation tasks shipped in data/tasks/ from the validation split of the bundled
corpus (data/kjv.txt.gz), with the standard library only:

  kjv_verse_completion.jsonl  generative: the end of a verse as the prompt, its last three words
                              the answer (stop at the next verse);
  kjv_next_verse.jsonl        multiple choice: a verse (its last CONTEXT_CHARS characters at most)
                              and the next verse's number as the context, the start of that verse
                              and of three verses from other chapters as the endings.

The validation split is the one launch/quickstart.sh makes with `make_shards --tokenizer byte
--val-fraction 0.05`: the last round(0.05 * N) bytes of the N-byte text. Items start at the first
verse wholly inside it. The text is kept as the corpus has it (line breaks where it wraps), so a
model trained on the corpus sees familiar text. A completion item is at most MAX_CHARS characters
(prompt and answer), a next-verse item at most NEXT_VERSE_MAX_CHARS (context and any ending), so
that both fit a byte-level model's sequence of 256 (the quickstart configs). Choices are drawn by
a fixed splitmix64 stream, so the output depends on nothing but the corpus. The next-verse
context is a whole verse where it fits: with 40 characters the quickstart model scored 0.265 /
0.282 (acc / acc_norm, chance 0.25), with 200 0.290 / 0.297 (docs/evaluation.md).

    python3 scripts/make_kjv_tasks.py [--corpus data/kjv.txt.gz] [--out data/tasks]
"""
import argparse
import gzip
import json
import os
import re

VAL_FRACTION = 0.05
MAX_CHARS = 90          # a completion item: prompt + " " + answer, in characters
NEXT_VERSE_MAX_CHARS = 250  # a next-verse item: context + " " + ending
CONTEXT_CHARS = 200     # the end of the previous verse in a next-verse item
ENDING_CHARS = 40       # the start of each candidate verse
PROMPT_CHARS = 60       # the verse before its last words, in a completion item
ANSWER_WORDS = 3
ITEMS = 250             # verse completion
NEXT_VERSE_ITEMS = 1000  # four-way choice: a 1.4-point standard error, so a few points above chance show
SEED = 20240527

VERSE = re.compile(r"^  (\d+) (.*)$")


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & 0xFFFFFFFFFFFFFFFF

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)

    def below(self, n):
        return self.next() % n


def validation_text(corpus):
    data = gzip.open(corpus, "rb").read()
    tail = int(VAL_FRACTION * len(data) + 0.5)  # as std::llround in make_shards
    return data, len(data) - tail


def parse_verses(data, start):
    """Verses whose first byte is at or after `start`: (chapter key, number, raw text)."""
    verses = []
    chapter = None
    offset = 0
    current = None
    in_verse = False  # inside a verse, before or after `start`
    for raw_line in data.split(b"\n"):
        line = raw_line.decode("utf-8")
        line_start = offset
        offset += len(raw_line) + 1
        match = VERSE.match(line)
        if match or line.strip() == "":
            if current is not None:
                verses.append(current)
            current = None
            in_verse = bool(match)
            if match and line_start >= start:
                current = [chapter, int(match.group(1)), match.group(2)]
        elif not in_verse:
            chapter = line.strip()  # "Book N", between blank lines
        elif current is not None:
            current[2] += "\n" + line  # a wrapped line of the verse
    if current is not None:
        verses.append(current)
    return [tuple(v) for v in verses if v[0] is not None]


def word_starts(text):
    return [m.start() for m in re.finditer(r"\S+", text)]


def tail_at_word(text, limit):
    """The longest tail of `text` of at most `limit` characters starting at a word."""
    for s in word_starts(text):
        if len(text) - s <= limit:
            return text[s:]
    return None


def head_at_word(text, limit):
    """The longest head of `text` of at most `limit` characters ending at a word."""
    best = None
    for m in re.finditer(r"\S+", text):
        if m.end() <= limit:
            best = text[: m.end()]
    return best


def spread(items, count):
    """`count` items evenly over the list (all when there are fewer)."""
    if len(items) <= count:
        return items
    return [items[i * len(items) // count] for i in range(count)]


def completion_items(verses):
    items = []
    for chapter, number, text in verses:
        starts = word_starts(text)
        if len(starts) < ANSWER_WORDS + 5:
            continue
        cut = starts[-ANSWER_WORDS]
        answer = " ".join(text[cut:].split())
        head = f"  {number} " + text[:cut].rstrip()
        prompt = head if len(head) <= PROMPT_CHARS else tail_at_word(head, PROMPT_CHARS)
        if prompt is None or len(prompt) + 1 + len(answer) > MAX_CHARS:
            continue
        items.append({"prompt": prompt, "answers": [answer], "stop": ["\n  "], "source": f"{chapter}:{number}"})
    return spread(items, ITEMS)


def next_verse_items(verses, rng):
    pairs = [(verses[i - 1], verses[i]) for i in range(1, len(verses))
             if verses[i - 1][0] == verses[i][0] and verses[i][1] == verses[i - 1][1] + 1]
    pairs = spread(pairs, NEXT_VERSE_ITEMS)
    items = []
    for previous, current in pairs:
        whole = f"  {previous[1]} {previous[2]}"
        context_tail = whole if len(whole) <= CONTEXT_CHARS else tail_at_word(previous[2], CONTEXT_CHARS)
        context = f"{context_tail}\n  {current[1]}"
        endings = [head_at_word(current[2], ENDING_CHARS)]
        while len(endings) < 4:
            other = verses[rng.below(len(verses))]
            if other[0] == current[0]:
                continue  # another chapter, so the true verse is the only continuation
            ending = head_at_word(other[2], ENDING_CHARS)
            if ending is not None and ending not in endings:
                endings.append(ending)
        label = rng.below(4)
        endings[0], endings[label] = endings[label], endings[0]
        assert len(context) + 1 + max(len(e) for e in endings) <= NEXT_VERSE_MAX_CHARS
        items.append({"ctx": context, "endings": endings, "label": label, "source": f"{current[0]}:{current[1]}"})
    return items


def write(path, items):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")
    print(f"{path}: {len(items)} items")


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=os.path.join(root, "data", "kjv.txt.gz"))
    parser.add_argument("--out", default=os.path.join(root, "data", "tasks"))
    parser.add_argument("--context-chars", type=int, default=CONTEXT_CHARS, help="next verse: context")
    parser.add_argument("--ending-chars", type=int, default=ENDING_CHARS, help="next verse: each ending")
    parser.add_argument("--max-chars", type=int, default=NEXT_VERSE_MAX_CHARS, help="next verse: an item")
    args = parser.parse_args()
    globals().update(CONTEXT_CHARS=args.context_chars, ENDING_CHARS=args.ending_chars,
                     NEXT_VERSE_MAX_CHARS=args.max_chars)
    data, start = validation_text(args.corpus)
    verses = parse_verses(data, start)
    os.makedirs(args.out, exist_ok=True)
    write(os.path.join(args.out, "kjv_verse_completion.jsonl"), completion_items(verses))
    write(os.path.join(args.out, "kjv_next_verse.jsonl"), next_verse_items(verses, SplitMix64(SEED)))


if __name__ == "__main__":
    main()
