"""tools/preprocess_data.py throughput on this machine: documents/s and tokens/s with 1 and 2 worker processes, on a
generated corpus (paragraphs of the shipped Shakespeare sample, as JSON lines) and the tiny GPT-2 tokenizer.

    python bench/preprocess_data.py --documents 20000 --out bench/results/preprocess_data_cpu.json
"""

import argparse
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
sys.path.insert(0, REPO)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--documents", type=int, default=20000)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--tokenizer", default=os.path.join(REPO, "examples", "tokenizers", "tiny-gpt2"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import preprocess_data

    text = open(os.path.join(REPO, "examples", "data", "tiny_shakespeare_sample.txt"), encoding="utf-8").read()
    paragraphs = [t for t in text.split("\n\n") if t.strip()]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        corpus = os.path.join(work, "corpus.jsonl")
        with open(corpus, "w") as f:
            for i in range(args.documents):
                f.write(json.dumps({"text": "\n\n".join(paragraphs[(i * 7 + k) % len(paragraphs)] for k in range(4))})
                        + "\n")
        for workers in map(int, args.workers.split(",")):
            counts = preprocess_data.main(["--input", corpus, "--output-prefix", os.path.join(work, f"w{workers}"),
                                           "--tokenizer-model", args.tokenizer, "--append-eod",
                                           "--workers", str(workers)])
            rows.append(dict(workers=workers, documents=counts["documents"], tokens=counts["tokens"],
                             seconds=counts["seconds"], documents_per_sec=counts["documents_per_sec"],
                             tokens_per_sec=counts["tokens_per_sec"]))
    print(f"{'workers':>7} {'documents':>10} {'tokens':>11} {'seconds':>8} {'docs/s':>8} {'tokens/s':>10}")
    for r in rows:
        print(f"{r['workers']:>7} {r['documents']:>10,} {r['tokens']:>11,} {r['seconds']:>8.1f} "
              f"{r['documents_per_sec']:>8,.0f} {r['tokens_per_sec']:>10,.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=f"cpu ({os.cpu_count()} cores)", tokenizer="tiny-gpt2 (2048 tokens)", rows=rows),
                      f, indent=2)


if __name__ == "__main__":
    main()
