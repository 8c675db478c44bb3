import sys, json
sys.path.insert(0, "tests")
from support.ranks import run_ranks
sys.path.insert(0, "tests/training")
from test_finetune_e2e import COMMON
def main():
  out = sys.argv[1]
  for name, extra in (("eager", []), ("compiled", ["--compile-layers"])):
      p = run_ranks(2, COMMON + ["--train-iters", "2", "--log-dir", f"{out}/{name}"] + extra, check=False, timeout=600)
      print(name, p.returncode, (p.stdout + p.stderr)[-1500:] if p.returncode else "")
      try:
          print([json.loads(l).get("loss") for l in open(f"{out}/{name}/metrics.jsonl")])
      except Exception as e:
          print(e)

if __name__ == "__main__":
    main()
