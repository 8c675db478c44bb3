"""Write a small, deterministic MetaMathQA-shaped data set, so SFT runs and tests need no download.

Records have MetaMathQA's schema (``query``, ``response``, ``type``, ``original_question``) and its conventions:
``*_AnsAug`` asks the original question, ``*_Rephrased`` rewords it, ``*_FOBAR`` hides one number as x and gives
the answer; every response reasons in a few short sentences and ends with ``The answer is: N``.

    python tools/make_metamathqa_sample.py            # -> examples/data/metamathqa_sample.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Callable, Dict, List, NamedTuple, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "examples", "data", "metamathqa_sample.jsonl")

HE = ["James", "Tom", "Ken", "Omar", "Leo", "Sam", "Carlos", "Daniel", "Ethan", "Felix", "George", "Hiro",
      "Ivan", "Jamal", "Kofi", "Liam", "Marco", "Noah", "Oscar", "Pablo", "Rahul", "Stefan", "Tariq", "Victor",
      "Wesley", "Yusuf", "Zane", "Arjun", "Bruno", "Dmitri"]
SHE = ["Maria", "Aisha", "Lucy", "Priya", "Nina", "Mei", "Beatrice", "Chloe", "Diana", "Elena", "Fatima", "Grace",
       "Hannah", "Isabel", "Julia", "Keiko", "Laura", "Monique", "Natalia", "Olivia", "Paula", "Rosa", "Sofia",
       "Tamara", "Ursula", "Valentina", "Wendy", "Yasmin", "Zoe", "Camille"]
NAMES = [(name, "he") for name in HE] + [(name, "she") for name in SHE]
ITEMS = ["notebook", "pencil", "pear", "candle", "ticket", "sticker", "cupcake", "marble", "book", "plant",
         "balloon", "bracelet", "cookie", "crayon", "cushion", "doughnut", "eraser", "feather", "guitar string",
         "hammer", "jigsaw puzzle", "kite", "lantern", "magazine", "muffin", "necklace", "paintbrush", "plum",
         "postcard", "pretzel", "puppet", "bagel", "scarf", "seashell", "skateboard", "sock", "spoon",
         "sunflower", "teacup", "towel", "toy car", "umbrella", "wallet", "whistle", "yo-yo"]


class Hidden(NamedTuple):
    """The number a FOBAR variant hides as x: its phrase in the question, its value, the answer as f(x)."""

    phrase: str
    value: int
    answer_of: Callable[[int], int]  # linear in x


class Problem(NamedTuple):
    """One word problem: two wordings, the solution and, if it has a FOBAR variant, the number to hide."""

    question: str
    rephrased: str
    steps: List[str]
    answer: int
    hidden: Optional[Hidden]


def shopping(rng: random.Random) -> Problem:
    (name, he), item = rng.choice(NAMES), rng.choice(ITEMS)
    n, price = rng.randint(2, 9), rng.randint(2, 12)
    cost = n * price
    bill = next(b for b in (10, 20, 50, 100, 200) if b > cost)
    return Problem(
        question=f"{name} buys {n} {item}s at ${price} each and pays with a ${bill} bill. "
                 f"How much change does {he} get?",
        rephrased=f"If {name} pays for {n} {item}s costing ${price} apiece with a ${bill} bill, "
                  f"what is {name}'s change?",
        steps=[f"The {item}s cost {n} * {price} = ${cost}.", f"The change is {bill} - {cost} = ${bill - cost}."],
        answer=bill - cost, hidden=Hidden(f"${price} each", price, lambda x: bill - n * x))


def sharing(rng: random.Random) -> Problem:
    (name, he), item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, keep = rng.randint(2, 8), rng.randint(2, 15), rng.randint(1, 9)
    total = friends * each + keep
    return Problem(
        question=f"{name} has {total} {item}s. {he.capitalize()} keeps {keep} and shares the rest equally "
                 f"among {friends} friends. How many {item}s does each friend get?",
        rephrased=f"Out of {total} {item}s, {name} keeps {keep} and splits the others evenly between "
                  f"{friends} friends. How many does each friend receive?",
        steps=[f"{name} shares {total} - {keep} = {total - keep} {item}s.",
               f"Each friend gets {total - keep} / {friends} = {each}."],
        answer=each, hidden=None)


def ages(rng: random.Random) -> Problem:
    (older, _), (younger, _) = rng.sample(NAMES, 2)
    gap, young_age, years = rng.randint(2, 30), rng.randint(3, 40), rng.randint(2, 15)
    now = young_age + gap
    return Problem(
        question=f"{older} is {gap} years older than {younger}. {younger} is {young_age} years old. "
                 f"How old will {older} be in {years} years?",
        rephrased=f"{younger} is {young_age}, and {older} is {gap} years older. "
                  f"What will {older}'s age be {years} years from now?",
        steps=[f"{older} is {young_age} + {gap} = {now} years old now.",
               f"In {years} years {older} will be {now} + {years} = {now + years}."],
        answer=now + years, hidden=Hidden(f"{gap} years older", gap, lambda x: young_age + x + years))


def travel(rng: random.Random) -> Problem:
    v, t, w, u = rng.randint(20, 70), rng.randint(2, 6), rng.randint(20, 70), rng.randint(1, 5)
    first, second = v * t, w * u
    return Problem(
        question=f"A train travels at {v} miles per hour for {t} hours, then at {w} miles per hour for {u} hours. "
                 f"How many miles does it travel in total?",
        rephrased=f"How far does a train go in total if it runs {t} hours at {v} mph and then {u} hours "
                  f"at {w} mph?",
        steps=[f"First it covers {v} * {t} = {first} miles.", f"Then it covers {w} * {u} = {second} miles.",
               f"In total it travels {first} + {second} = {first + second} miles."],
        answer=first + second, hidden=Hidden(f"for {t} hours", t, lambda x: v * x + second))


def reading(rng: random.Random) -> Problem:
    name, pages, days = rng.choice(NAMES)[0], rng.randint(5, 40), rng.randint(2, 9)
    total = pages * days + rng.randint(10, 200)
    return Problem(
        question=f"A book has {total} pages. {name} reads {pages} pages a day. "
                 f"How many pages are left after {days} days?",
        rephrased=f"{name} is reading a {total}-page book at {pages} pages per day. "
                  f"After {days} days, how many pages remain?",
        steps=[f"In {days} days {name} reads {pages} * {days} = {pages * days} pages.",
               f"The pages left are {total} - {pages * days} = {total - pages * days}."],
        answer=total - pages * days, hidden=Hidden(f"after {days} days", days, lambda x: total - pages * x))


def savings(rng: random.Random) -> Problem:
    (name, he), wage, hours = rng.choice(NAMES), rng.randint(8, 25), rng.randint(5, 20)
    spend, weeks = rng.randint(10, wage * hours - 10), rng.randint(2, 8)
    earned, saved = wage * hours, wage * hours - spend
    return Problem(
        question=f"{name} earns ${wage} an hour and works {hours} hours a week. {he.capitalize()} spends ${spend} "
                 f"a week. How much does {he} save in {weeks} weeks?",
        rephrased=f"Working {hours} hours weekly at ${wage} per hour and spending ${spend} each week, "
                  f"how much money does {name} save over {weeks} weeks?",
        steps=[f"{name} earns {wage} * {hours} = ${earned} a week.",
               f"{he.capitalize()} saves {earned} - {spend} = ${saved} a week.",
               f"In {weeks} weeks {he} saves {saved} * {weeks} = ${saved * weeks}."],
        answer=saved * weeks, hidden=Hidden(f"in {weeks} weeks", weeks, lambda x: (earned - spend) * x))


def discount(rng: random.Random) -> Problem:
    item, price, percent, n = rng.choice(ITEMS), 20 * rng.randint(1, 10), 5 * rng.randint(1, 10), rng.randint(2, 9)
    off = price * percent // 100
    sale = price - off
    return Problem(
        question=f"A {item} costs ${price}. It is on sale for {percent}% off. How much do {n} {item}s cost "
                 f"on sale?",
        rephrased=f"With {percent}% off the ${price} price, what is the cost of {n} {item}s?",
        steps=[f"The discount is {percent}% of {price} = ${off}.", f"One {item} costs {price} - {off} = ${sale}.",
               f"{n} {item}s cost {sale} * {n} = ${sale * n}."],
        answer=sale * n, hidden=Hidden(f"do {n} {item}s", n, lambda x: sale * x))


def baking(rng: random.Random) -> Problem:
    (name, he), batches, flour, sugar = rng.choice(NAMES), rng.randint(2, 9), rng.randint(2, 6), rng.randint(1, 4)
    per_batch = flour + sugar
    return Problem(
        question=f"{name} bakes {batches} batches of biscuits. Each batch needs {flour} cups of flour and {sugar} "
                 f"cups of sugar. How many cups of flour and sugar does {he} use altogether?",
        rephrased=f"A biscuit recipe calls for {flour} cups of flour and {sugar} cups of sugar per batch. If {name} "
                  f"makes {batches} batches, how many cups of ingredients are needed in total?",
        steps=[f"Each batch uses {flour} + {sugar} = {per_batch} cups.",
               f"For {batches} batches {he} uses {per_batch} * {batches} = {per_batch * batches} cups."],
        answer=per_batch * batches, hidden=Hidden(f"bakes {batches} batches", batches, lambda x: per_batch * x))


def garden(rng: random.Random) -> Problem:
    rows, plants, tomatoes = rng.randint(2, 12), rng.randint(3, 15), rng.randint(4, 20)
    per_row = plants * tomatoes
    return Problem(
        question=f"A vegetable garden has {rows} rows with {plants} tomato plants in each row. Every plant "
                 f"produces {tomatoes} tomatoes. How many tomatoes does the garden produce?",
        rephrased=f"If each tomato plant yields {tomatoes} tomatoes and there are {plants} plants in each of "
                  f"{rows} rows, how many tomatoes are harvested altogether?",
        steps=[f"Each row produces {plants} * {tomatoes} = {per_row} tomatoes.",
               f"The garden produces {per_row} * {rows} = {per_row * rows} tomatoes."],
        answer=per_row * rows, hidden=Hidden(f"has {rows} rows", rows, lambda x: per_row * x))


WORD_PROBLEMS = [shopping, sharing, ages, travel, reading, savings, discount, baking, garden]


def arithmetic_record(rng: random.Random) -> Dict[str, str]:
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(1, 99)
    question = f"What is the value of ${a} \\times {b} + {c}$?"
    steps = [f"First, {a} * {b} = {a * b}.", f"Then {a * b} + {c} = {a * b + c}."]
    return dict(query=question, response=respond(steps, a * b + c), type="MATH_AnsAug", original_question=question)


def solve_for_x(hidden: Hidden, answer: int) -> List[str]:
    """Sentences solving ``slope*x + intercept = answer`` for x, as MetaMathQA's FOBAR responses do."""
    intercept = hidden.answer_of(0)
    slope = hidden.answer_of(1) - intercept
    k = abs(slope)
    term = "x" if k == 1 else f"{k}x"
    side = term if intercept == 0 else f"{intercept} + {term}" if slope > 0 else f"{intercept} - {term}"
    steps = [f"With x in place of the hidden number, the answer is {side}.",
             f"We know it is {answer}, so {side} = {answer}."]
    moved = answer - intercept if slope > 0 else intercept - answer
    if intercept:
        moved_side = f"{answer} - {intercept}" if slope > 0 else f"{intercept} - {answer}"
        steps.append(f"So {term} = {moved_side} = {moved}.")
    if k != 1:
        steps.append(f"So x = {moved} / {k} = {hidden.value}.")
    return steps


def make_record(rng: random.Random) -> Dict[str, str]:
    if rng.random() < 0.1:
        return arithmetic_record(rng)
    p = rng.choice(WORD_PROBLEMS)(rng)
    kinds = ["AnsAug", "Rephrased", "FOBAR"] if p.hidden else ["AnsAug", "Rephrased"]
    kind = rng.choices(kinds, weights=[4, 3, 3][:len(kinds)])[0]
    if kind == "FOBAR":
        phrase = p.hidden.phrase
        query = (p.question.replace(phrase, phrase.replace(str(p.hidden.value), "x", 1), 1)
                 + f"\nIf we know the answer to the above question is {p.answer}, "
                   f"what is the value of unknown variable x?")
        return dict(query=query, response=respond(solve_for_x(p.hidden, p.answer), p.hidden.value),
                    type="GSM_FOBAR", original_question=p.question)
    query = p.rephrased if kind == "Rephrased" else p.question
    return dict(query=query, response=respond(p.steps, p.answer), type=f"GSM_{kind}", original_question=p.question)


def respond(steps: List[str], answer: int) -> str:
    return " ".join(steps) + f"\nThe answer is: {answer}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--num-records", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        for _ in range(args.num_records):
            f.write(json.dumps(make_record(rng)) + "\n")
    print(f"wrote {args.num_records} records to {args.out} ({os.path.getsize(args.out) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
