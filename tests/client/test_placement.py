"""Placement: grouping by name, the spec parser and both planners (unit + property)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import rpcbuf
from models import gguf_tensors, llama_tensors
from rpcbuf.models import placement as PL

MiB = 1 << 20


def slots(*caps: int, allocator: str = "linear", endpoint: str = "n") -> list[PL.Slot]:
    return [PL.Slot(i, f"{endpoint}{i}:7700", "CPU", 0, c, c, allocator)
            for i, c in enumerate(caps)]


def model_groups(n_layers: int, layer_bytes: int = 1000, pro: int = 5000,
                 epi: int = 3000) -> PL.Groups:
    items = [("tok_embeddings.weight", pro)]
    for i in range(n_layers):
        items += [(f"layers.{i}.attention.wq.weight", layer_bytes),
                  (f"layers.{i}.ffn_norm.weight", 64)]
    items += [("norm.weight", 64), ("output.weight", epi)]
    return PL.Groups.of(items)


def test_classify_llama_hf_and_gguf_names() -> None:
    assert PL.classify("tok_embeddings.weight") == "prolog"
    assert PL.classify("model.embed_tokens.weight") == "prolog"
    assert PL.classify("token_embd.weight") == "prolog"
    assert PL.classify("rope_freqs.weight") == "prolog"
    assert PL.classify("layers.7.attention.wq.weight") == 7
    assert PL.classify("model.layers.12.input_layernorm.weight") == 12
    assert PL.classify("blk.31.ffn_down.weight") == 31
    assert PL.classify("transformer.h.3.attn.c_attn.weight") == 3
    for name in ("norm.weight", "model.norm.weight", "output.weight", "lm_head.weight",
                 "output_norm.weight", "transformer.ln_f.weight"):
        assert PL.classify(name) == "epilog", name
    g = PL.Groups.of({n: a.nbytes for n, a in llama_tensors(3).items()})
    assert g.layer_ids == [0, 1, 2] and g.prolog == ["model.embed_tokens.weight"]
    assert g.epilog == ["model.norm.weight", "lm_head.weight"]
    gg = PL.Groups.of({n: a.nbytes for n, a in gguf_tensors(2).items()})
    assert gg.prolog == ["token_embd.weight", "rope_freqs.weight"]
    assert gg.epilog == ["output_norm.weight", "output.weight"] and len(gg.layers) == 2


def test_spec_from_the_issue() -> None:
    g = model_groups(30)
    p = PL.plan_from_spec(g, slots(MiB, MiB, MiB), "0:prolog,epilog;1:20;2:all")
    s0, s1, s2 = p.slots
    assert s0.prolog and s0.epilog and s0.layers == (0, 0)
    assert s1.layers == (0, 20) and s2.layers == (20, 30)
    assert s0.tensors == ["tok_embeddings.weight", "norm.weight", "output.weight"]
    assert s1.tensors[0] == "layers.0.attention.wq.weight"
    assert s2.tensors[-1] == "layers.29.ffn_norm.weight"
    assert s1.nbytes == rpcbuf.calculate_buffer_size([(1000,)] * 0 + [
        ((1000,), "uint8"), ((64,), "uint8")] * 20, headroom=0)


@pytest.mark.parametrize(("spec", "words"), [
    ("", "empty"),
    ("0 prolog", "no ':'"),
    ("x:prolog", "not a number"),
    ("0:prolog;0:epilog", "appears twice"),
    ("0:prolog,lots", "unknown item"),
    ("0:prolog,3,4", "twice"),
    ("0:3,all", "twice"),
    ("0:prolog;1:all;2:all,epilog", "more than one"),
    ("0:prolog,epilog;1:prolog,all", "to slots [0, 1]"),
    ("0:prolog,epilog,0;1:all", "at least 1"),
    ("0:prolog,epilog;5:all", "slot 5 does not exist"),
    ("0:prolog;1:all", "epilog"),
    ("0:epilog;1:all", "prolog"),
    ("0:prolog,epilog;1:10", "left over"),
    ("0:prolog,epilog;1:10;2:30", "has 30"),
    ("0:prolog,epilog;1:all;2:10", "largest free block"),
])
def test_bad_specs_say_what_to_change(spec: str, words: str) -> None:
    g = model_groups(30)
    with pytest.raises(rpcbuf.BadRequest) as info:
        PL.plan_from_spec(g, slots(MiB, MiB, 4096), spec)
    assert words in info.value.message, info.value.message
    assert info.value.details


def test_auto_is_proportional_to_free_memory() -> None:
    g = model_groups(40, layer_bytes=10_000)
    p = PL.plan_auto(g, slots(4 * MiB, MiB, 3 * MiB))
    counts = [s.layers[1] - s.layers[0] for s in p.slots]
    assert sum(counts) == 40 and counts[0] > counts[2] > counts[1]
    assert p.slots[0].prolog and p.slots[-1].epilog
    again = PL.plan_from_spec(g, slots(4 * MiB, MiB, 3 * MiB), p.spec)  # the spec reproduces it
    assert [s.tensors for s in again.slots] == [s.tensors for s in p.slots]


def test_auto_falls_back_to_packing_and_reports_a_model_too_big() -> None:
    g = model_groups(10, layer_bytes=10_000)
    # free memory says "mostly slot 1", but slot 1's largest free block is small
    skewed = [PL.Slot(0, "a:1", "CPU", 0, 200_000, 200_000, "linear"),
              PL.Slot(1, "b:1", "CPU", 0, 10 * MiB, 30_000, "linear")]
    p = PL.plan_auto(g, skewed)
    assert all(s.nbytes <= s.slot.capacity for s in p.slots)
    with pytest.raises(rpcbuf.BadRequest) as info:
        PL.plan_auto(g, slots(20_000, 20_000))
    assert "does not fit" in info.value.message and info.value.details["model_bytes"] > 0
    assert "--placement" in info.value.message  # two slots: a split is the user's to choose
    with pytest.raises(rpcbuf.BadRequest):
        PL.plan_auto(g, slots(0, 0))


def test_too_big_messages_speak_in_units_and_do_not_offer_a_split_of_one_node() -> None:
    """Issue 28, item 12: "206606336 bytes", and --placement for one node."""
    g = model_groups(10, layer_bytes=300 * 1024)
    with pytest.raises(rpcbuf.BadRequest) as info:
        PL.plan_auto(g, slots(MiB))
    msg = info.value.message
    assert "--placement" not in msg and "add nodes" in msg, msg
    assert "MiB in aligned tensors" in msg and "(1.0 MiB)" in msg and " bytes" not in msg, msg
    with pytest.raises(rpcbuf.BadRequest) as info:
        PL.plan_from_spec(g, slots(MiB, MiB), "0:prolog,10;1:epilog")
    assert "it needs 2.9 MiB, its largest free block is 1.0 MiB" in info.value.message, \
        info.value.message


def test_buddy_capacity_is_its_largest_block() -> None:
    s = PL.Slot(0, "a:1", "CPU", 0, 3 * MiB, 2 * MiB, "buddy")
    assert s.capacity == 2 * MiB
    assert PL.Slot(0, "a:1", "CPU", 0, 1000, 1000, "linear").capacity == 768


# -- properties ----------------------------------------------------------------------

entries = st.lists(
    st.tuples(st.booleans(), st.booleans(), st.one_of(st.none(), st.integers(1, 50)),
              st.booleans()),
    min_size=1, max_size=6)


@given(entries, st.randoms(use_true_random=False))
def test_format_then_parse_roundtrips(raw: list[tuple[bool, bool, int | None, bool]],
                                      rnd) -> None:  # type: ignore[no-untyped-def]
    order = list(range(len(raw)))
    rnd.shuffle(order)
    built: list[PL.Entry] = []
    seen_p = seen_e = seen_rest = False
    for slot, (p, e, count, rest) in zip(order, raw, strict=True):
        p, e = p and not seen_p, e and not seen_e
        rest = rest and count is None and not seen_rest
        seen_p, seen_e, seen_rest = seen_p or p, seen_e or e, seen_rest or rest
        if p or e or count or rest:  # "3:" says nothing and is refused
            built.append(PL.Entry(slot, p, e, count, rest))
    if built:
        assert PL.parse_spec(PL.format_spec(built)) == built


@given(st.text(alphabet="0123456789:;, prologepilogalx", max_size=40))
def test_parser_never_fails_otherwise(text: str) -> None:
    try:
        PL.parse_spec(text)
    except rpcbuf.BadRequest:
        pass


def _check_plan(g: PL.Groups, p: PL.Placement) -> None:
    placed = [n for s in p.slots for n in s.tensors]
    assert sorted(placed) == sorted(g.sizes), "every tensor exactly once"
    assert sum(1 for s in p.slots if s.prolog and g.prolog) <= 1
    cursor = 0
    for s in sorted(p.slots, key=lambda s: s.layers[0]):
        if s.layers[1] > s.layers[0]:
            assert s.layers[0] == cursor, "layers contiguous, in order"
            cursor = s.layers[1]
        assert s.nbytes <= s.slot.capacity
        assert s.nbytes == g.bytes_of(s.tensors)
    assert cursor == len(g.layers)


layer_sizes = st.lists(st.integers(1, 5000), min_size=0, max_size=12)


@given(layer_sizes, st.lists(st.integers(0, 40_000), min_size=1, max_size=4),
       st.integers(1, 8000), st.integers(1, 8000))
@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
def test_auto_places_everything_whenever_a_split_exists(sizes: list[int], caps: list[int],
                                                        pro: int, epi: int) -> None:
    items = [("token_embd.weight", pro)] + \
        [(f"blk.{i}.w", n) for i, n in enumerate(sizes)] + [("output.weight", epi)]
    g = PL.Groups.of(items)
    sl = slots(*caps)
    try:
        p = PL.plan_auto(g, sl)
    except rpcbuf.BadRequest:
        p = None
    else:
        _check_plan(g, p)
    usable = [s for s in sl if s.capacity > 0]
    feasible = False  # brute force: prolog on the first usable slot, epilog on the last
    lb = [g.bytes_of(layer) for layer in g.layers]
    splits = itertools.combinations_with_replacement(range(len(lb) + 1), len(usable) - 1) \
        if usable else iter([])
    for cuts in splits:
        bounds = [0, *cuts, len(lb)]
        need = [sum(lb[bounds[j]:bounds[j + 1]]) for j in range(len(usable))]
        if usable:
            need[0] += g.bytes_of(g.prolog)
            need[-1] += g.bytes_of(g.epilog)
        if usable and all(n <= s.capacity for n, s in zip(need, usable, strict=True)):
            feasible = True
            break
    assert (p is not None) == feasible


@given(st.integers(0, 15), st.lists(st.integers(0, 6), min_size=1, max_size=4),
       st.booleans(), st.data())
def test_spec_plans_exactly_or_refuses(n_layers: int, counts: list[int], use_rest: bool,
                                       data) -> None:  # type: ignore[no-untyped-def]
    g = model_groups(n_layers)
    sl = slots(*[MiB] * (len(counts) + 1))
    es = [PL.Entry(0, prolog=True, epilog=True)]
    for i, c in enumerate(counts):
        last = i == len(counts) - 1
        if last and use_rest:
            es.append(PL.Entry(i + 1, rest=True))
        elif c:
            es.append(PL.Entry(i + 1, count=c))
    spec = data.draw(st.permutations(es))
    try:
        p = PL.plan_from_spec(g, sl, PL.format_spec(spec))
    except rpcbuf.BadRequest as exc:
        counted = sum(e.count or 0 for e in spec)
        rest = any(e.rest for e in spec)
        assert counted > n_layers or (counted < n_layers and not rest), exc.message
        return
    _check_plan(g, p)
    cursor = 0
    for e in spec:  # layers are handed out in the order the spec lists the slots
        got = next((s for s in p.slots if s.slot.slot == e.slot), None)
        take = e.count or (n_layers - sum(x.count or 0 for x in spec) if e.rest else 0)
        if take:
            assert got is not None and got.layers == (cursor, cursor + take)
        cursor += take
