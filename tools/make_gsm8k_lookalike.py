"""Write seeded, synthetic GSM8K-style problems, so evaluation runs and tests need no download (and no GSM8K text).

Rows have GSM8K's schema and conventions: ``question`` is a short word problem, ``answer`` reasons in steps with
``<<a*b=c>>`` calculator annotations and ends in ``#### N``. The answers cover what extractors get wrong: thousands
written with commas (1,000), dollar amounts, negative numbers and decimals.

    python tools/make_gsm8k_lookalike.py --out gsm8k_lookalike.jsonl --num-records 200

``--metamath-out`` writes the same problems as MetaMathQA writes its GSM8K rows (``query``, ``response`` without
the annotations, ending "The answer is: N"): training rows for them (examples/math_recipe_cpu.sh ships both).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from typing import Dict, List, Tuple

NAMES = ["Avery", "Bilal", "Carmen", "Dev", "Esther", "Farid", "Greta", "Hugo", "Ines", "Jonah", "Kira", "Lars",
         "Mina", "Nikos", "Oona", "Pedro", "Quinn", "Rania", "Sven", "Tara"]
GOODS = ["chair", "lamp", "backpack", "helmet", "jacket", "printer", "tablet", "bicycle", "kettle", "desk"]
FRUIT = ["apples", "cherries", "grapes", "peaches", "plums", "walnuts"]
TOWNS = ["Northfield", "Lakeside", "Pine Hill", "Westbrook", "Eastport", "Stonebridge"]
Problem = Tuple[str, List[str], float]


def _fmt(value: float, commas: bool = False) -> str:
    """An answer as GSM8K writes it: integers without a decimal point, decimals without trailing zeros."""
    text = f"{value:,.2f}" if commas else f"{value:.2f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def bulk_order(rng: random.Random) -> Problem:
    item, boxes, price, ship = rng.choice(GOODS), rng.randint(20, 90), rng.randint(25, 99), rng.randint(20, 80)
    cost = boxes * price
    question = (f"A school orders {boxes} {item}s at ${price} each and pays ${ship} for delivery. "
                f"How many dollars does the order cost in total?")
    steps = [f"The {item}s cost {boxes} * ${price} = $<<{boxes}*{price}={cost}>>{cost}.",
             f"With delivery the order costs {cost} + {ship} = $<<{cost}+{ship}={cost + ship}>>{cost + ship}."]
    return question, steps, cost + ship


def cold_night(rng: random.Random) -> Problem:
    town, noon, drop = rng.choice(TOWNS), rng.randint(1, 15), rng.randint(16, 35)
    question = (f"At noon the temperature in {town} was {noon} degrees. By midnight it had fallen by {drop} "
                f"degrees. What was the temperature at midnight?")
    steps = [f"The temperature at midnight was {noon} - {drop} = <<{noon}-{drop}={noon - drop}>>{noon - drop} "
             f"degrees."]
    return question, steps, noon - drop


def fruit_stand(rng: random.Random) -> Problem:
    name, fruit = rng.choice(NAMES), rng.choice(FRUIT)
    pounds, price = rng.choice([3, 5, 7, 9]), rng.choice([1.25, 1.5, 2.25, 2.5, 3.75])
    total = pounds * price
    question = f"{name} buys {pounds} pounds of {fruit} at ${_fmt(price)} per pound. How much does {name} pay?"
    steps = [f"{name} pays {pounds} * ${_fmt(price)} = $<<{pounds}*{_fmt(price)}={_fmt(total)}>>{_fmt(total)}."]
    return question, steps, total


def stickers(rng: random.Random) -> Problem:
    name, start, packs, per, given = (rng.choice(NAMES), rng.randint(5, 40), rng.randint(2, 9), rng.randint(3, 12),
                                      rng.randint(2, 10))
    bought = packs * per
    question = (f"{name} has {start} stickers. {name} buys {packs} packs with {per} stickers in each pack and then "
                f"gives {given} stickers to a friend. How many stickers does {name} have now?")
    steps = [f"{name} buys {packs} * {per} = <<{packs}*{per}={bought}>>{bought} stickers.",
             f"{name} has {start} + {bought} - {given} = <<{start}+{bought}-{given}={start + bought - given}>>"
             f"{start + bought - given} stickers now."]
    return question, steps, start + bought - given


def wages(rng: random.Random) -> Problem:
    name, wage, hours, weeks = rng.choice(NAMES), rng.randint(12, 40), rng.randint(10, 40), rng.randint(4, 12)
    weekly = wage * hours
    question = (f"{name} earns ${wage} an hour and works {hours} hours a week. How much does {name} earn in "
                f"{weeks} weeks?")
    steps = [f"{name} earns {wage} * {hours} = $<<{wage}*{hours}={weekly}>>{weekly} a week.",
             f"In {weeks} weeks that is {weekly} * {weeks} = $<<{weekly}*{weeks}={weekly * weeks}>>"
             f"{weekly * weeks}."]
    return question, steps, weekly * weeks


TEMPLATES = [bulk_order, cold_night, fruit_stand, stickers, wages]


def make_rows(num_records: int, seed: int = 0) -> List[Dict[str, str]]:
    """``num_records`` rows ``{"question", "answer"}``, the same for the same seed; every template appears once
    in each run of five rows, and answers of 1,000 or more are written with commas about half the time."""
    rng = random.Random(seed)
    rows = []
    for i in range(num_records):
        question, steps, value = TEMPLATES[i % len(TEMPLATES)](rng)
        final = _fmt(value, commas=abs(value) >= 1000 and rng.random() < 0.5)
        rows.append({"question": question, "answer": "\n".join(steps) + f"\n#### {final}"})
    return rows


def as_metamath(row: Dict[str, str]) -> Dict[str, str]:
    """A GSM8K row in MetaMathQA's layout: the steps without ``<<...>>`` annotations, then MetaMath's answer line."""
    *steps, final = row["answer"].split("\n")
    response = " ".join(re.sub(r"<<[^>]*>>", "", step) for step in steps)
    return {"query": row["question"], "response": f"{response} The answer is: {final.removeprefix('#### ')}"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--out", required=True, help="output .jsonl file")
    parser.add_argument("--num-records", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metamath-out", default=None, help="also write the problems as MetaMathQA rows here")
    args = parser.parse_args(argv)
    if args.num_records < 1:
        parser.error(f"--num-records must be >= 1, got {args.num_records}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rows = make_rows(args.num_records, args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"wrote {args.num_records} GSM8K-style problems to {args.out}")
    if args.metamath_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.metamath_out)), exist_ok=True)
        with open(args.metamath_out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(as_metamath(row)) + "\n" for row in rows)
        print(f"wrote them as MetaMathQA rows to {args.metamath_out}")


if __name__ == "__main__":
    main()
