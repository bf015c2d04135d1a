"""A code-editing workload: each prompt carries a 300-600-token Python function and asks
for it back with one small change (an argument renamed), the traffic of coding agents
and editors, where most of an answer repeats its prompt. Written as a JSONL file that
`vllm bench serve --dataset-name custom` reads ({"prompt", "output_tokens"} a line), so
every system is measured on the same requests.

    python -m bench.code_edit --out build/code-edit.jsonl --num-prompts 32

The functions come from this interpreter's standard library (fixed modules, in file
order), measured in the served model's tokens; each prompt's output_tokens is its
function's length plus a few tokens for the code fence.
"""
from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path

MODULES = ("textwrap.py", "difflib.py", "statistics.py", "fractions.py", "calendar.py", "shlex.py", "heapq.py",
           "argparse.py", "configparser.py", "tarfile.py", "zipfile/__init__.py", "inspect.py", "pprint.py",
           "string.py", "base64.py", "csv.py", "json/encoder.py", "json/decoder.py", "gettext.py", "ipaddress.py")
MIN_TOKENS, MAX_TOKENS = 300, 600
TEMPLATE = ("Here is a Python function:\n\n```python\n{code}\n```\n\nRewrite it with the argument `{old}` renamed "
            "to `{new}` everywhere. Reply with the whole function in a code block and nothing else.")


def functions(source: str):
    """(code, argument names) of each top-level function or method, in file order."""
    tree = ast.parse(source)
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            args = [a.arg for a in node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")]
            start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            code = "\n".join(lines[start:node.end_lineno])
            indent = len(code) - len(code.lstrip())
            yield "\n".join(line[indent:] for line in code.splitlines()), args


def build(tokenizer, num_prompts: int) -> list[dict]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out: list[dict] = []
    for name in MODULES:
        path = stdlib / name
        if not path.is_file():
            continue
        for code, args in functions(path.read_text(encoding="utf-8")):
            n = len(tokenizer.encode(code, add_special_tokens=False))
            if not (MIN_TOKENS <= n <= MAX_TOKENS) or not args:
                continue
            old = max(args, key=len)
            out.append({"prompt": TEMPLATE.format(code=code, old=old, new=f"{old}_value"),
                        "output_tokens": n + 16, "function_tokens": n, "source": name})
            if len(out) == num_prompts:
                return out
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.code_edit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--model", default=None, help="tokenizer of this model folder (default: the served default)")
    args = p.parse_args(argv)
    from services.engine.text.model_store import resolve_model
    from services.engine.text.tokenizer import load_tokenizer
    rows = build(load_tokenizer(resolve_model(args.model, None)), args.num_prompts)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokens = sorted(r["function_tokens"] for r in rows)
    print(f"{len(rows)} prompts, functions of {tokens[0]}-{tokens[-1]} tokens (median {tokens[len(tokens) // 2]}) "
          f"-> {args.out}")
    return 0 if len(rows) == args.num_prompts else 1


if __name__ == "__main__":
    raise SystemExit(main())
