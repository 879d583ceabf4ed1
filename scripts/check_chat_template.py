#!/usr/bin/env python3
"""Checks `upipe tokenize`'s chat, prompt/completion and text documents
against Hugging Face transformers, token for token and mask for mask.

    python3 scripts/check_chat_template.py TOKENIZER_DIR DATA.jsonl OUT.u32

TOKENIZER_DIR: the model's tokenizer directory (tokenizer.json,
tokenizer_config.json with its chat_template), as given to `upipe tokenize
--tokenizer`. DATA.jsonl: the JSONL file (plain or .gz) that was tokenized,
alone, into OUT.u32 (with OUT.u32.docs and, for chat data, OUT.u32.mask
beside it). Needs `pip install transformers`. Prints PASS or FAIL (with the
first differing document) and exits 0 or 1.

The reference, line by line (blank lines skipped):
- `messages`: `apply_chat_template(messages, tokenize=True,
  add_generation_prompt=False)`; the counted tokens are its
  `assistant_masks` when the template has `{% generation %}` blocks,
  otherwise the tokens overlapping each assistant turn's text: from the
  rendering of the messages before it with the generation prompt to the
  rendering up to it (upipe's rule, docs/documents.md).
- `prompt`/`completion`: the prompt with the tokenizer's special tokens,
  then the completion and EOS, only the latter counted.
- text (`--field`, default `text`): the text with the special tokens, then
  EOS, all counted.
"""

import argparse
import gzip
import json
import struct
import sys


def read_ids(path, width):
    data = open(path, "rb").read()
    fmt = "<%d%s" % (len(data) // width, "I" if width == 4 else "H")
    return list(struct.unpack(fmt, data))


def read_index(path):
    data = open(path, "rb").read()
    assert data[:8] == b"UPIPEDIX", f"{path}: not a upipe document index"
    version, _, tokens, docs = struct.unpack("<IIQQ", data[8:32])
    assert version == 1, f"{path}: version {version}"
    starts = list(struct.unpack("<%dQ" % docs, data[32 : 32 + 8 * docs]))
    return starts, tokens


def read_mask(path, tokens):
    try:
        data = open(path, "rb").read()
    except FileNotFoundError:
        return [True] * tokens
    assert data[:8] == b"UPIPEMSK", f"{path}: not a upipe loss mask"
    bits = data[24:]
    return [bool(bits[i // 8] >> (i % 8) & 1) for i in range(tokens)]


def lines(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def eos_id(tok, tokenizer_dir):
    try:
        cfg = json.load(open(f"{tokenizer_dir}/config.json"))
        e = cfg.get("eos_token_id")
        if e is not None:
            return e[0] if isinstance(e, list) else e
    except FileNotFoundError:
        pass
    return tok.eos_token_id


def chat_reference(tok, messages):
    template = tok.chat_template if isinstance(tok.chat_template, str) else ""
    if "generation" in template and "endgeneration" in template:
        out = tok.apply_chat_template(
            messages,
            tokenize=True,
            add_generation_prompt=False,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    render = lambda m, gen: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=gen)
    text = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            before, upto = render(messages[:i], True), render(messages[: i + 1], False)
            assert text.startswith(upto) and upto.startswith(before), "template not turn by turn"
            spans.append((len(before), len(upto)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(s < e2 and e > s2 for s2, e2 in spans) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def reference(tok, eos, line, field):
    with_eos = lambda ids: ids if ids and ids[-1] == eos else ids + [eos]
    if field in line:
        ids = with_eos(tok(line[field], add_special_tokens=True)["input_ids"])
        return ids, [True] * len(ids)
    if "messages" in line:
        return chat_reference(tok, line["messages"])
    prompt = tok(line["prompt"], add_special_tokens=True)["input_ids"]
    answer = with_eos(tok(line["completion"], add_special_tokens=False)["input_ids"])
    return prompt + answer, [False] * len(prompt) + [True] * len(answer)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tokenizer_dir")
    p.add_argument("data")
    p.add_argument("ids")
    p.add_argument("--field", default="text")
    a = p.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.tokenizer_dir)
    eos = eos_id(tok, a.tokenizer_dir)
    ids = read_ids(a.ids, 4 if a.ids.endswith(".u32") else 2)
    starts, tokens = read_index(a.ids + ".docs")
    assert tokens == len(ids), f"index for {tokens} ids, file holds {len(ids)}"
    mask = read_mask(a.ids + ".mask", tokens)
    ends = starts[1:] + [tokens]
    docs = 0
    for d, line in enumerate(lines(a.data)):
        want_ids, want_mask = reference(tok, eos, line, a.field)
        if d >= len(starts):
            print(f"FAIL: upipe wrote {len(starts)} documents, the data has more")
            return 1
        got_ids, got_mask = ids[starts[d] : ends[d]], mask[starts[d] : ends[d]]
        if got_ids != want_ids or got_mask != want_mask:
            print(f"FAIL: document {d} (line {d + 1} of non-blank lines)")
            print(f"  transformers ids  {want_ids}")
            print(f"  upipe ids         {got_ids}")
            print(f"  transformers mask {[int(m) for m in want_mask]}")
            print(f"  upipe mask        {[int(m) for m in got_mask]}")
            return 1
        docs += 1
    if docs != len(starts):
        print(f"FAIL: upipe wrote {len(starts)} documents, the data has {docs}")
        return 1
    print(f"PASS: {docs} documents equal transformers token for token, masks included")
    return 0


if __name__ == "__main__":
    sys.exit(main())
