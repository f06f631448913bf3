#!/usr/bin/env python
"""What a decode step's projections cost on this CPU, by the form of the product. Prints JSON.

    .venv/bin/python scripts/bench_matmul.py [--model default] [--layers 10] [--repeats 9] [--max-rows 8] [--context 37]
    .venv/bin/python scripts/bench_matmul.py --model tiny --layers 2 --repeats 1 --max-rows 2   # CI smoke size

For 1 to 8 rows (the tokens of a decode batch) and a 64-row prefill chunk, the median time of every projection of
``--layers`` layers of the model through ``F.linear``, the few-columns form and each packed-weight kernel this
machine has (``swarm.models.backends.cpu.matmul``; the 4-bit one only for weights that are 4-bit), plus the LM head for one
row, on one torch thread; a greedy step's LM head for 1 to 8 rows, dense and through each argmax screen
(``swarm.models.backends.cpu.argmax``; Int8InputScreen's finish in C and in torch); and the forms ``matmul.calibrate`` chose
for them on this machine. Where the range takes the 4-bit form, also whole decode calls of those layers
(sessions with 37 cached tokens, one new token each) with the layers in one call of ``int4.decode_layers`` and
written out in torch operations, alternated;
``--context 1024`` times them with that many cached tokens instead (attention then weighs as much as products).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from swarm.models import Step
from swarm.models.backends.cpu import int4
from swarm.models.backends.cpu.argmax import SCREENS, ArgmaxScreen, Int8InputScreen
from swarm.models.backends.cpu.held import Int4Linear
from swarm.models.backends.cpu.int4 import LayerWeights
from swarm.models.backends.cpu.matmul import PACKED_ROWS, Forms, NotFourBit, calibrate, linear, pack, packers
from swarm.models.head import ClientHead
from swarm.models.loading import ModelSource, resolve_model

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _median_ms(repeats: int, run: Callable[[], object]) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return round(1e3 * statistics.median(times), 4)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="default | tiny[:SEED] | checkpoint dir")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--max-rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=37, help="tokens cached before a timed decode step")
    args = parser.parse_args(argv)
    if args.context < 1:
        parser.error(f"--context must be at least 1, got {args.context}")
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same inputs every run
    source = resolve_model(args.model)
    layers = min(args.layers, source.spec.num_layers)
    blocks = source.load_blocks(0, layers, cache_tokens=0)
    # the float32 weights (widened where the range holds them as 4-bit), to time every form on
    weights = [
        m.widened() if isinstance(m, Int4Linear) else m.weight
        for m in blocks.layers.modules()
        if isinstance(m, torch.nn.Linear | Int4Linear)
    ]
    head = source.load_head()
    forms, head_forms = calibrate(weights, packing=True), calibrate([head.lm_head_weight], packing=True)
    every_row = {name: Forms(packer=name, packed_rows=frozenset(range(1, PACKED_ROWS + 1)), packed_beyond=True)
                 for name in packers()}  # fmt: skip
    packed = {name: _copies(name, [*weights, head.lm_head_weight]) for name in packers()}
    # a packer that cannot pack every weight (int4: only exactly 4-bit weights) is timed where it can
    for_projections = [name for name in packers() if all(id(w) in packed[name] for w in weights)]
    for_head = [name for name in packers() if id(head.lm_head_weight) in packed[name]]

    def packed_product(name: str) -> Product:
        return lambda x, w: linear(x, w, None, every_row[name], packed[name][id(w)])

    def projections(product: Product, rows: int) -> float:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        return _median_ms(args.repeats, lambda: [product(inputs[w.shape[1]], w) for w in weights])

    by_rows = {
        str(rows): {
            "F.linear": projections(F.linear, rows),
            "few_columns": projections(functools.partial(linear, forms=Forms(few_rows=rows)), rows),
            **{f"packed_{name}": projections(packed_product(name), rows) for name in for_projections},
        }
        for rows in [*range(1, args.max_rows + 1), 64]
    }
    hidden = torch.randn(1, source.spec.hidden_size)
    lm_head = {
        "F.linear": _median_ms(args.repeats, lambda: F.linear(hidden, head.lm_head_weight)),
        "few_columns": _median_ms(
            args.repeats, lambda: linear(hidden, head.lm_head_weight, None, Forms(few_rows=1))
        ),
        **{
            f"packed_{name}": _median_ms(
                args.repeats, lambda name=name: packed_product(name)(hidden, head.lm_head_weight)
            )
            for name in for_head
        },
    }
    greedy_head = _greedy_head(head, args.max_rows, args.repeats)
    decode_calls = _decode_calls(source, layers, args.max_rows, args.repeats, args.context)
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
    print(
        json.dumps(
            {
                "model": source.spec.name,
                "layers": layers,
                "projection_mb": round(megabytes, 1),
                "calibrated": {
                    "projections": _forms_json(forms),
                    "lm_head": _forms_json(head_forms),
                },
                "projections_ms_by_rows": by_rows,
                "lm_head_ms_one_row": lm_head,
                "greedy_lm_head_ms_by_rows": greedy_head,
                "decode_call_ms_by_rows": decode_calls,
                "decode_context_tokens": args.context,
            }
        )
    )


def _greedy_head(head: ClientHead, max_rows: int, repeats: int) -> dict[str, dict[str, float]]:
    """{rows: {"dense": ms, screen: ms, ...}}: a greedy step's LM head for rows of 1, 2, 4 and 8 (up to
    ``max_rows``), on normed embedding rows spread over the vocabulary, as ClientHead calibrates its screen (the
    logits of real last hidden states have a clear top; those of random rows are flat)."""
    ids = torch.linspace(0, head.spec.vocab_size - 1, max_rows).long()
    with torch.no_grad():
        sample = head.norm(head.embed_weight[ids])
    screens: dict[str, ArgmaxScreen] = {}
    for kind in SCREENS:
        if kind.available(head.hidden_size):
            screens[kind.__name__] = kind(head.lm_head_weight)
    in_c = screens.get("Int8InputScreen")
    if isinstance(in_c, Int8InputScreen) and in_c.finish is not None:
        in_torch = Int8InputScreen(head.lm_head_weight)
        in_torch.finish = None
        screens["Int8InputScreen_finished_in_torch"] = in_torch
    timed = {}
    for rows in (r for r in (1, 2, 4, 8) if r <= max_rows):
        x = sample[:rows]
        times = {"dense": _median_ms(repeats, functools.partial(head.kernels.logits, x))}
        for name, screen in screens.items():
            times[name] = _median_ms(repeats, functools.partial(screen.logits, x, head.kernels.logits))
        timed[str(rows)] = times
    return timed


def _decode_calls(
    source: ModelSource, layers: int, max_rows: int, repeats: int, context: int
) -> dict[str, dict[str, float]] | None:
    """{rows: {"decode_layer": ms, "written_out": ms}} for a decode call of ``layers`` layers, each row a
    session with ``context`` cached tokens (None where the calibrated forms leave the layers unfused: weights not
    4-bit, no kernel); where the kernel is built for AVX-512 here, "decode_layer_avx2_build" too."""
    blocks = source.load_blocks(0, layers, cache_tokens=(context + 1) * max_rows, pack_bytes=2**40)
    fused = list(blocks.kernels._fused)
    if not all(fused):
        return None
    hidden = source.spec.hidden_size
    calls: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in sorted({1, max(1, max_rows // 2), max_rows}):
            if not blocks.kernels.forms.packs(rows):
                continue
            sessions = [f"bench-{rows}-{i}" for i in range(rows)]
            for session in sessions:
                blocks.open_session(session, context + 1)
                blocks.forward([Step(session, torch.randn(context, hidden), 0, layers, 0)])
            unfused: list[LayerWeights | None] = [None] * len(fused)
            forms = [("decode_layer", fused, None), ("written_out", unfused, None)]
            if int4.flags() != int4.FLAGS:  # this machine's build against the AVX2 one
                forms.append(("decode_layer_avx2_build", fused, int4.FLAGS))
            times: dict[str, list[float]] = {name: [] for name, _, _ in forms}
            for _ in range(max(1, repeats)):  # alternated: a slow spell of the machine hits each
                for name, form, build in forms:
                    blocks.kernels._fused = form
                    # replayed: the same position each time
                    steps = [Step(s, torch.randn(1, hidden), 0, layers, context) for s in sessions]
                    with int4.built_with(build) if build else contextlib.nullcontext():
                        times[name].append(_median_ms(5, functools.partial(blocks.forward, steps)))
            blocks.kernels._fused = fused
            calls[str(rows)] = {name: statistics.median(ms) for name, ms in times.items()}
            for session in sessions:
                blocks.close_session(session)
    return calls


def _copies(packer: str, weights: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """``packer``'s copies of the weights it can pack, by ``id(weight)``."""
    copies = {}
    for weight in weights:
        with contextlib.suppress(NotFourBit):
            copies[id(weight)] = pack(weight, packer)
    return copies


def _forms_json(forms: Forms) -> dict[str, object]:
    return {
        "few_rows": forms.few_rows,
        "packer": forms.packer,
        "packed_rows": sorted(forms.packed_rows),
        "packed_beyond": forms.packed_beyond,
    }


if __name__ == "__main__":
    main()
