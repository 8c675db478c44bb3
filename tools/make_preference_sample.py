"""Write examples/data/preference_sample.jsonl: arithmetic questions whose chosen answer works the sum out and whose
rejected one brushes the question off (a style a tiny model learns to prefer within a few DPO steps on CPU), in
TRL's conversational explicit-prompt layout (lists of messages: the chat template renders them).

    python tools/make_preference_sample.py --out examples/data/preference_sample.jsonl
"""

import argparse
import json
import random

BRUSH_OFFS = ["I don't know.", "Figure it out yourself.", "Why would I tell you?", "No idea, sorry.",
              "Ask someone else.", "That is not my problem."]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="examples/data/preference_sample.jsonl")
    p.add_argument("--num-records", type=int, default=240)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for _ in range(args.num_records):
            a, b, op = rng.randint(2, 40), rng.randint(2, 40), rng.choice("+-*")
            right = a + b if op == "+" else a - b if op == "-" else a * b
            prompt, chosen = f"What is {a} {op} {b}?", f"{a} {op} {b} = {right}. The answer is {right}."
            f.write(json.dumps({"prompt": [{"role": "user", "content": prompt}],
                                "chosen": [{"role": "assistant", "content": chosen}],
                                "rejected": [{"role": "assistant", "content": rng.choice(BRUSH_OFFS)}]}) + "\n")


if __name__ == "__main__":
    main()
