"""The reference's answers to the judge (``sanity.nll_judge``), kept on disk and asked once.

The judge asks the transformers reference two kinds of question: its own greedy output on an
open-ended prompt, and its teacher-forced scores of a continuation (logprobs, top-k). Both are a
function of the reference model, its options and the question alone, and every backend judged on
the same model asks mostly the same ones (engines that agree produce the same continuations). So
the answers are kept under ``<bakeoff cache>/judge/<reference key>/``, keyed as the reference's
probe outputs are (:func:`evaluations.reference._model_stamp`: the model folder's files, sizes and
times, and the options), and the reference is started only when a question was never answered:
a ``bakeoff qualify`` of several engines on one fixture starts it once instead of once per engine
(about 12 s a run on this project's CPU hosts, mostly scoring 240 probe outputs one by one).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

from bakeoff.host import envs

JUDGE_CACHE_VERSION = 2  # 2: scores leave a trailing EOS unscored on both sides


class ReferenceAnswers:
    """Answers of the reference, from the cache or from a reference started on the first miss.

    Args:
        reference_key: what identifies the reference (model path, its files' stamp, options).
        start: starts the reference and returns it (a backend with ``base_url``); called at
            most once, on the first question not in the cache.
        score: ``score(base_url, prompt, ids, text, top_k) -> dict`` (the ``/v1/score`` call).
        generate: ``generate(backend, [(id, prompt, max_tokens)]) -> [{"status", "output_token_ids",
            "output_text"}]``.
    """

    def __init__(self, reference_key: list, start: Callable, score: Callable, generate: Callable):
        blob = json.dumps([JUDGE_CACHE_VERSION, reference_key], sort_keys=True)
        self.root = envs.cache_root() / "judge" / hashlib.sha256(blob.encode()).hexdigest()[:16]
        self._start, self._score, self._generate = start, score, generate
        self.backend = None
        self.asked = 0
        self.cached = 0

    def _path(self, question: list) -> Path:
        return self.root / f"{hashlib.sha256(json.dumps(question).encode()).hexdigest()[:24]}.json"

    def _read(self, question: list) -> dict | None:
        try:
            entry = json.loads(self._path(question).read_text())
        except (OSError, ValueError):
            return None
        ok = isinstance(entry, dict) and entry.get("question") == question and isinstance(entry.get("answer"), dict)
        return entry["answer"] if ok else None  # damaged or another question's: asked again

    def _write(self, question: list, answer: dict) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.root, delete=False, suffix=".tmp") as fh:
                json.dump({"question": question, "answer": answer}, fh)
            os.replace(fh.name, self._path(question))
        except OSError:  # a cache that cannot be written costs time, never a verdict
            pass

    def _live(self):
        if self.backend is None:
            self.backend = self._start()
        return self.backend

    def generate(self, prompts: list[tuple[str, str, int]]) -> list[dict]:
        """The reference's greedy outputs on ``(id, prompt, max_tokens)``, in order."""
        questions = [["generate", prompt, max_tokens] for _, prompt, max_tokens in prompts]
        out = [self._read(q) for q in questions]
        self.asked += len(questions)
        self.cached += sum(o is not None for o in out)
        missing = [i for i, o in enumerate(out) if o is None]
        if missing:
            fresh = self._generate(self._live(), [prompts[i] for i in missing])
            for i, answer in zip(missing, fresh):
                out[i] = answer
                if answer["status"] == "ok":
                    self._write(questions[i], answer)
        return out

    def score(self, prompt: str, ids: list[int] | None, text: str, top_k: int = 0) -> dict:
        """The reference's ``/v1/score`` answer for a continuation (token ids, else text)."""
        question = ["score", prompt, ids if ids else None, None if ids else text, top_k]
        self.asked += 1
        answer = self._read(question)
        if answer is not None:
            self.cached += 1
            return answer
        answer = self._score(self._live().base_url, prompt, ids, text, top_k)
        self._write(question, answer)
        return answer
