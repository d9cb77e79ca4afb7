"""Per-family accuracy of the transformers reference on bakeoff's generic probes, with near-ties.

What ``sanity.known_answers`` rests on for a model that ships no probes: the reference must
answer at least ``MIN_BASELINE_ACCURACY`` of :func:`bakeoff.analysis.generic_probes.generic_probes`
(completion form, and chat form through the checkpoint's chat template), and the probes it
answers should be answered with a margin that another host's numerics do not flip. This script
decodes every probe greedily as the reference does (``model.generate``, ``do_sample=False``,
``max_new_tokens`` from :func:`evaluations.probing.probe_max_tokens`, stopping at EOS), judges it
with :func:`bakeoff.analysis.sanity.probe_correct`, and prints per family: correct / probes, and
among the correct ones how many are near-ties (< ``--tie`` nats between the top-1 and top-2
logprobs) at the answer's first token, and anywhere up to the answer's end (a chat reply's
prose before the answer can flip too).

``--batch 1`` (the default) runs one probe at a time, as the reference does; a larger batch
pads on the left and is faster, at the cost of slightly different numerics. Asserts nothing;
needs torch and transformers (``pip install -e '.[reference]'``).

Usage::

    .venv/bin/python benchmarks/probe_families.py --model /path/to/hf --dtype float32
    .venv/bin/python benchmarks/probe_families.py --model /path/to/hf --dtype bfloat16 --batch 16 --out /tmp/bf16.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bakeoff.analysis.generic_probes import chat_template_of, generic_probes
from bakeoff.analysis.sanity import probe_correct
from evaluations.probing import probe_max_tokens


def answer_span(text: str, expected: str, match: str) -> tuple[int, int] | None:
    """Character span of the expected answer in a correct output (leading whitespace skipped)."""
    exp = expected.strip()
    if match == "contains":
        m = re.search(r"(?<![0-9A-Za-z])" + re.escape(exp) + r"(?![0-9A-Za-z])", text)
        return (m.start(), m.end()) if m else None
    start = len(text) - len(text.lstrip())
    return start, start + len(exp)


def margins_at(tok, token_ids: list[int], margins: list[float], span: tuple[int, int]) -> tuple[float, float]:
    """``(margin at the answer's first token, smallest margin up to its last token)``."""
    first = last = None
    for t in range(len(token_ids)):
        end = len(tok.decode(token_ids[:t + 1]))
        if first is None and end > span[0]:
            first = t
        if end >= span[1]:
            last = t
            break
    first = first if first is not None else len(token_ids) - 1
    last = last if last is not None else len(token_ids) - 1
    return margins[first], min(margins[:last + 1])


def decode(model, tok, probes: list[dict], batch: int) -> list[dict]:
    """Greedy outputs with the top-1 minus top-2 logprob margin of every generated token."""
    import torch

    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    enc = [tok(p["prompt"])["input_ids"] for p in probes]
    order = sorted(range(len(probes)), key=lambda i: (probes[i]["match"], len(enc[i])))
    out: list[dict] = [{} for _ in probes]
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        width = max(len(enc[i]) for i in idx)
        ids = torch.tensor([[pad] * (width - len(enc[i])) + enc[i] for i in idx])
        mask = torch.tensor([[0] * (width - len(enc[i])) + [1] * len(enc[i]) for i in idx])
        limits = [probe_max_tokens(probes[i]["expected"], probes[i]["match"]) for i in idx]
        with torch.inference_mode():
            g = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(limits), do_sample=False,
                               output_scores=True, return_dict_in_generate=True, pad_token_id=pad, eos_token_id=eos)
        for row, (i, limit) in enumerate(zip(idx, limits)):
            token_ids = g.sequences[row, width:width + limit].tolist()
            if eos in token_ids:
                token_ids = token_ids[:token_ids.index(eos)]
            top2 = [torch.log_softmax(g.scores[t][row].float(), -1).topk(2).values for t in range(len(token_ids))]
            out[i] = {"token_ids": token_ids, "text": tok.decode(token_ids),
                      "margins": [float(v[0] - v[1]) for v in top2]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a local Hugging Face checkpoint folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=1, help="probes per generate call (1: as the reference runs)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--tie", type=float, default=0.5, help="a margin below this many nats is a near-tie")
    ap.add_argument("--per-family", type=int, default=None, help="completion probes per family (default: the set's)")
    ap.add_argument("--chat-per-family", type=int, default=None, help="chat probes per family (default: the set's)")
    ap.add_argument("--out", help="write every probe's output, correctness and margins here (JSON)")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).eval()
    template, special = chat_template_of(a.model)
    sizes = {k: v for k, v in (("per_family", a.per_family), ("chat_per_family", a.chat_per_family)) if v is not None}
    probes = generic_probes(chat_template=template, special=special, **sizes)
    t0 = time.perf_counter()
    outs = decode(model, tok, probes, a.batch)
    rows = []
    for p, o in zip(probes, outs):
        ok = probe_correct(o["text"], p["expected"], p["match"])
        span = answer_span(o["text"], p["expected"], p["match"]) if ok and o["token_ids"] else None
        first, path = margins_at(tok, o["token_ids"], o["margins"], span) if span else (None, None)
        rows.append({**p, "text": o["text"], "correct": ok, "answer_margin": first, "path_margin": path})

    print(f"{a.model}  dtype={a.dtype}  batch={a.batch}  {time.perf_counter() - t0:.0f} s; near-tie: < {a.tie} nats")
    print(f"{'family':18s} {'correct':>9s} {'acc':>6s} {'tie@answer':>11s} {'tie@path':>9s}")
    for form, chat in (("completion", False), ("chat", True)):
        part = [r for r in rows if (r["match"] == "contains") == chat]
        for task in dict.fromkeys(r["task"] for r in part):
            fam = [r for r in part if r["task"] == task]
            ok = [r for r in fam if r["correct"]]
            print(f"{task:18s} {len(ok):4d}/{len(fam):<4d} {len(ok) / len(fam):6.1%} "
                  f"{sum(r['answer_margin'] < a.tie for r in ok):11d} {sum(r['path_margin'] < a.tie for r in ok):9d}")
        if part:
            ok = [r for r in part if r["correct"]]
            print(f"{'= ' + form:18s} {len(ok):4d}/{len(part):<4d} {len(ok) / len(part):6.1%} "
                  f"{sum(r['answer_margin'] < a.tie for r in ok):11d} {sum(r['path_margin'] < a.tie for r in ok):9d}")
    ok = sum(r["correct"] for r in rows)
    print(f"{'= all':18s} {ok:4d}/{len(rows):<4d} {ok / len(rows):6.1%}")
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "dtype": a.dtype, "batch": a.batch, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
