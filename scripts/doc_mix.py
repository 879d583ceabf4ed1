"""A realistic long-context document mix, for benchmarks of packed windows.

Writes JSONL documents (`{"text": ...}`) of random printable ASCII whose
lengths are long-tailed (log-normal, mean about MEAN bytes, a few longer than
32K), deterministic for a seed, and their lengths one per line beside them.
With the byte tokenizer one byte is one token, so the lengths are the
documents' token counts before BOS/EOS.

    python3 scripts/doc_mix.py --out mix.jsonl --tokens 1000000
    upipe tokenize mix.jsonl --tokenizer byte --out mix.u32
"""

import argparse
import json
import math
import random


def lengths(total: int, mean: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    sigma = 1.0
    mu = math.log(mean) - sigma * sigma / 2  # E[lognormal] = exp(mu + sigma^2/2)
    out, n = [], 0
    while n < total:
        n_doc = max(16, min(200_000, int(rng.lognormvariate(mu, sigma))))
        out.append(n_doc)
        n += n_doc
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--mean", type=float, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed + 1)
    lens = lengths(a.tokens, a.mean, a.seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz      .,\n"
    with open(a.out, "w") as f:
        for n in lens:
            f.write(json.dumps({"text": "".join(rng.choices(alphabet, k=n))}) + "\n")
    with open(a.out + ".lengths", "w") as f:
        f.write("\n".join(map(str, lens)) + "\n")
    big = sum(1 for n in lens if n > 32768)
    print(f"{len(lens)} documents, {sum(lens)} bytes, mean {sum(lens) / len(lens):.0f}, "
          f"{big} longer than 32K, longest {max(lens)}")


if __name__ == "__main__":
    main()
