"""Training text the teacher writes itself: batched sampling, cached on disk, the seed recorded.

Each sample starts as the tokenizer starts a text (its BOS where it adds one) and one token drawn uniformly
from the vocabulary (special tokens excluded), then the teacher samples at temperature 1 (no top-k/top-p),
so the text follows the teacher's own distribution. Batch b is generated under torch seed (seed, b): a cache
with fewer batches is extended, never regenerated, and ranks of a multi-process run write different batches
of the same cache.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

from attnkit.io.tempdirs import atomic_file
from attnkit.runtime.texts import text_prefix

#: Samples per generate() call; part of the cache key, so one cache serves every device.
SAMPLE_BATCH = 128
SAMPLER = {
    "prompt": "the tokenizer's text prefix and one uniform random non-special token",
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "batch": SAMPLE_BATCH,
    "version": 2,
}


def cache_folder(root: Path, teacher_digest: str, seed: int, length: int) -> Path:
    """The cache folder of one (teacher, seed, sample length, sampler) combination."""
    key = json.dumps({"teacher": teacher_digest, "seed": seed, "length": length, **SAMPLER}, sort_keys=True)
    return Path(root) / f"heal-samples-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _generate(model, tokenizer, batch: int, length: int, seed: int):
    """One batch of samples: LongTensor [SAMPLE_BATCH, length] (text prefix P, a random token, length - P - 1
    sampled tokens)."""
    import torch
    from transformers import GenerationConfig

    gen = torch.Generator().manual_seed(seed * 1_000_003 + batch)
    special = set(tokenizer.all_special_ids)
    allowed = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    first = allowed[torch.randint(len(allowed), (SAMPLE_BATCH, 1), generator=gen)]  # [S, 1]
    prefix = torch.tensor(text_prefix(tokenizer), dtype=torch.long).expand(SAMPLE_BATCH, -1)  # [S, P]
    prompt = torch.cat([prefix, first], dim=1)  # [S, P + 1]
    torch.manual_seed(seed * 1_000_003 + batch)
    eos = tokenizer.eos_token_id
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=length - prompt.shape[1],
        pad_token_id=eos if eos is not None else 0,
        eos_token_id=eos,
    )
    device = model.get_input_embeddings().weight.device
    with torch.no_grad():
        out = model.generate(
            prompt.to(device), attention_mask=torch.ones_like(prompt, device=device), generation_config=config
        )
    return torch.nn.functional.pad(out.cpu(), (0, length - out.shape[1]), value=config.pad_token_id)


def _documents(ids, eos: int | None, prefix: list[int]) -> list[list[int]]:
    """Rows of ids [S, L] without the text prefix they start with, cut before their first EOS."""
    docs = []
    for row in ids.tolist():
        row = row[len(prefix) :]
        if eos is not None and eos in row:
            row = row[: row.index(eos)]
        if row:
            docs.append(row)
    return docs


def _save(path: Path, ids) -> None:
    """Write one batch whole or not at all (attnkit.io.tempdirs.atomic_file)."""
    import torch
    from safetensors.torch import save_file

    with atomic_file(path) as tmp:
        save_file({"ids": ids.to(torch.int32).contiguous()}, str(tmp))


def _load(path: Path):
    from safetensors.torch import load_file

    return load_file(str(path))["ids"].long()


def teacher_documents(
    model,
    tokenizer,
    tokens: int,
    length: int,
    seed: int,
    folder: Path,
    *,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] = lambda: None,
    progress: Callable[[int], None] | None = None,
    enough: Callable[[int, bool], bool] | None = None,
) -> tuple[list[list[int]], dict]:
    """At least `tokens` tokens of teacher-written documents (token ids), from the cache where it has them.

    Rounds of `world` batches: rank r writes batch round * world + r when missing, then all ranks read the round.
    `enough(tokens so far, this rank must write its next batch)`, asked before every round after the first, ends
    the text early when it says so (a time budget; every rank must get the same answer).
    Returns (documents, info for the manifest).
    """

    folder.mkdir(parents=True, exist_ok=True)
    eos, prefix = tokenizer.eos_token_id, text_prefix(tokenizer)
    docs: list[list[int]] = []
    total = generated = batches = 0
    seconds = 0.0
    while total < tokens:
        mine = folder / f"batch-{batches + rank:05d}.safetensors"
        if batches and enough is not None and enough(total, not mine.is_file()):
            break
        if not mine.is_file():
            began = time.perf_counter()
            _save(mine, _generate(model, tokenizer, batches + rank, length, seed))
            seconds += time.perf_counter() - began
            generated += 1
        barrier()
        for b in range(batches, batches + world):
            new = _documents(_load(folder / f"batch-{b:05d}.safetensors"), eos, prefix)
            docs.extend(new)
            total += sum(len(d) for d in new)
            if progress is not None:
                progress(sum(len(d) for d in new))
        batches += world
    info = {
        "source": "teacher samples",
        "seed": seed,
        "sample_length": length,
        "samples": batches * SAMPLE_BATCH,
        "tokens": total,
        "cut_short": total < tokens,
        "cache": str(folder),
        "batches_written_here": generated,
        "seconds_writing_here": seconds,
        **SAMPLER,
    }
    return docs, info
