"""Synthetic tasks: determinism, train/eval disjointness, verifiers, sudoku generator."""

from __future__ import annotations

import random
import time

import pytest

from dlm_toolkit.tasks import TASKS, Instance, get_task, split_of
from dlm_toolkit.tasks.base import EVAL_MODULUS
from dlm_toolkit.tasks.sudoku import (
    SudokuTask,
    count_solutions,
    is_valid_solution,
    naked_single_rounds,
)

SYNTHETIC = ("add", "sort", "sudoku", "tiesort", "either", "pick")


def _pairs(insts: list[Instance]) -> list[tuple[str, str]]:
    return [(i.prompt, i.reference) for i in insts]


# ----------------------------------------------------------------------------- registry / args
def test_registry_and_unknown_name_lists_available() -> None:
    assert set(TASKS) == {"add", "sort", "sudoku", "humaneval", "tiesort", "either", "pick", "gsm8k", "gsm_plus",
                          "math500", "mbpp", "humaneval_plus", "mbpp_plus", "lm_eval", "livecodebench", "bigcodebench", "parallelbench",
                          "list_copy", "list_reverse", "list_sort", "list_shuffle", "list_replace", "list_insert",
                          "latin_square"}  # the oracle tasks: tests/test_oracle.py
    for name, cls in TASKS.items():
        assert cls.name == name
    with pytest.raises(ValueError) as err:
        get_task("multiply")
    msg = str(err.value)
    assert "multiply" in msg
    for name in TASKS:
        assert name in msg


def test_get_task_passes_kwargs() -> None:
    assert get_task("sudoku", clues=45).clues == 45
    assert get_task("add", max_digits=3).answer_length == 4


@pytest.mark.parametrize("name", [*SYNTHETIC, "humaneval"])
@pytest.mark.parametrize("n", [0, -3])
def test_nonpositive_n_raises(name: str, n: int) -> None:
    with pytest.raises(ValueError, match=rf"\bn={n}"):
        get_task(name).instances(n, seed=0, split="eval")


@pytest.mark.parametrize("name", SYNTHETIC)
def test_bad_split_raises(name: str) -> None:
    with pytest.raises(ValueError, match="split"):
        get_task(name).instances(3, seed=0, split="test")  # type: ignore[arg-type]


def test_metadata_fields() -> None:
    for name in [*SYNTHETIC, "humaneval"]:  # the benchmarks need data files: tests/test_benchmarks.py
        task = get_task(name)
        assert task.name == name and task.description and task.metric_name
        assert isinstance(task.answer_length, int) and task.answer_length > 0


# ----------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", SYNTHETIC)
def test_deterministic_under_seed(name: str) -> None:
    n = 20 if name == "sudoku" else 200
    task = get_task(name)
    a = task.instances(n, seed=7, split="train")
    b = get_task(name).instances(n, seed=7, split="train")
    assert _pairs(a) == _pairs(b)
    assert [i.meta for i in a] == [i.meta for i in b]
    assert _pairs(task.instances(n // 2, seed=7, split="train")) == _pairs(a[: n // 2])
    c = task.instances(n, seed=8, split="train")
    assert _pairs(a) != _pairs(c)
    assert len(set(_pairs(a)) & set(_pairs(c))) < n // 4


def test_answer_length_bounds_references() -> None:
    for name in SYNTHETIC:
        task = get_task(name)
        insts = task.instances(30 if name == "sudoku" else 1000, seed=0, split="train")
        assert max(len(i.reference) for i in insts) <= task.answer_length
    add = get_task("add")
    assert add.score(Instance("99999+99999=", "199998"), "199998") == 1.0
    assert len("199998") == add.answer_length
    assert get_task("sort").answer_length == len(",".join(["99"] * 16))


# ----------------------------------------------------------------------------- split
def test_split_function_is_deterministic_hash_with_eval_fraction() -> None:
    keys = [f"{a}+{b}" for a in range(100) for b in range(50)]
    splits = [split_of(k) for k in keys]
    assert splits == [split_of(k) for k in keys]
    frac = splits.count("eval") / len(splits)
    assert abs(frac - 1 / EVAL_MODULUS) < 0.02


@pytest.mark.parametrize("name", ["add", "sort"])
def test_train_eval_disjoint(name: str) -> None:
    task = get_task(name)
    evals = task.instances(500, seed=0, split="eval") + task.instances(500, seed=1, split="eval")
    eval_prompts = {i.prompt for i in evals}
    eval_keys = {task.canonical_key(i) for i in evals}
    assert all(task.split_of(i) == "eval" for i in evals)
    for seed in (0, 1, 2):
        train = task.instances(2000, seed=seed, split="train")
        assert all(task.split_of(i) == "train" for i in train)
        assert not eval_prompts & {i.prompt for i in train}
        assert not eval_keys & {task.canonical_key(i) for i in train}


@pytest.mark.parametrize("name", ["add", "sort"])
def test_split_function_is_what_guarantees_disjointness(name: str) -> None:
    """Raw generator draws hit both splits; ``instances`` keeps exactly those of its split."""
    task = get_task(name)
    rng = random.Random(0)
    raw = [task._sample(rng, "train") for _ in range(4000)]
    raw_splits = {task.split_of(i) for i in raw}
    assert raw_splits == {"train", "eval"}  # the generator alone would overlap
    train = task.instances(300, seed=5, split="train")
    evals = task.instances(300, seed=5, split="eval")
    assert {split_of(task.canonical_key(i)) for i in train} == {"train"}
    assert {split_of(task.canonical_key(i)) for i in evals} == {"eval"}


def test_add_canonical_key_is_commutative() -> None:
    task = get_task("add")
    for inst in task.instances(300, seed=3, split="eval"):
        a, b = inst.meta["a"], inst.meta["b"]
        swapped = Instance(f"{b}+{a}=", inst.reference)
        assert task.split_of(swapped) == "eval"


def test_sort_canonical_key_is_order_free() -> None:
    task = get_task("sort")
    for inst in task.instances(200, seed=3, split="eval"):
        nums = list(inst.meta["numbers"])
        random.Random(0).shuffle(nums)
        shuffled = Instance("sort:" + ",".join(map(str, nums)) + "=", inst.reference)
        assert task.split_of(shuffled) == "eval"


def test_sudoku_train_eval_disjoint() -> None:
    task = get_task("sudoku")
    train = task.instances(120, seed=0, split="train")
    evals = task.instances(40, seed=0, split="eval")
    assert {task.split_of(i) for i in train} == {"train"}
    assert {task.split_of(i) for i in evals} == {"eval"}
    assert not {i.reference for i in train} & {i.reference for i in evals}
    assert not {i.prompt for i in train} & {i.prompt for i in evals}


# ----------------------------------------------------------------------------- add / sort
def test_add_instances_and_verifier() -> None:
    task = get_task("add")
    insts = task.instances(2000, seed=0, split="train")
    digit_counts = set()
    for inst in insts:
        a, b = (int(x) for x in inst.prompt[:-1].split("+"))
        assert inst.prompt == f"{a}+{b}=" and inst.reference == str(a + b)
        digit_counts.update({len(str(a)), len(str(b))})
        assert task.score(inst, inst.reference) == 1.0
        assert task.score(inst, inst.reference + " \n") == 1.0
        assert task.score(inst, str(a + b + 1)) == 0.0
        assert task.score(inst, inst.reference + "0") == 0.0
        assert task.score(inst, " " + inst.reference) == 0.0
        assert task.score(inst, "") == 0.0
    assert digit_counts == {1, 2, 3, 4, 5}
    short = sum(len(str(i.meta["a"])) == 1 for i in insts) / len(insts)
    assert 0.15 < short < 0.25  # uniform digit count => ~1/5 one-digit operands


def test_sort_instances_and_verifier() -> None:
    task = get_task("sort")
    insts = task.instances(500, seed=0, split="train")
    lengths = set()
    for inst in insts:
        assert inst.prompt.startswith("sort:") and inst.prompt.endswith("=")
        nums = [int(x) for x in inst.prompt[5:-1].split(",")]
        lengths.add(len(nums))
        assert all(10 <= x <= 99 for x in nums)
        assert inst.reference == ",".join(map(str, sorted(nums)))
        assert task.score(inst, inst.reference) == 1.0
        assert task.score(inst, inst.reference + "\n") == 1.0
        parts = inst.reference.split(",")
        assert task.score(inst, ",".join(parts[:-1])) == 0.0  # dropped one
        if len(set(parts)) > 1:
            assert task.score(inst, ",".join(sorted(parts, reverse=True))) == 0.0
        assert task.score(inst, inst.prompt[5:-1]) == float(nums == sorted(nums))
    assert lengths == set(range(8, 17))


def test_score_batch() -> None:
    task = get_task("add")
    insts = task.instances(10, seed=0, split="eval")
    comps = [i.reference if k % 2 == 0 else "x" for k, i in enumerate(insts)]
    assert task.score_batch(insts, comps) == [1.0, 0.0] * 5
    assert task.score_batch(insts, comps, workers=1) == [1.0, 0.0] * 5
    with pytest.raises(ValueError, match="completions"):
        task.score_batch(insts, comps[:-1])


def test_chance_level_is_near_zero() -> None:
    assert get_task("add").chance_score(n=2000) < 0.02
    assert get_task("sort").chance_score(n=500) == 0.0
    assert get_task("sudoku").chance_score(n=20) == 0.0
    assert get_task("humaneval").chance_score() == 0.0


def test_instance_is_frozen_and_hashable() -> None:
    inst = Instance("1+1=", "2", {"a": 1})
    with pytest.raises(AttributeError):
        inst.prompt = "x"  # type: ignore[misc]
    assert len({inst, Instance("1+1=", "2", {"a": 1})}) == 1


# ----------------------------------------------------------------------------- sudoku
def test_sudoku_generator_valid_unique_and_fast() -> None:
    task = SudokuTask(clues=40)
    start = time.perf_counter()
    insts = task.instances(500, seed=0, split="train")
    elapsed = time.perf_counter() - start
    assert elapsed < 20.0, f"500 sudoku puzzles took {elapsed:.1f}s"
    assert len({i.reference for i in insts}) == 500
    for inst in insts:
        puzzle = inst.meta["puzzle"]
        assert inst.prompt == f"sudoku:{puzzle}="
        assert len(puzzle) == 81 and sum(ch != "." for ch in puzzle) == 40
        assert is_valid_solution(puzzle, inst.reference)
        assert task.score(inst, inst.reference) == 1.0
        assert inst.meta["naked_single_rounds"] == naked_single_rounds(puzzle)
    for inst in insts[:150]:
        assert count_solutions(inst.meta["puzzle"]) == 1


@pytest.mark.parametrize("clues", [30, 45])
def test_sudoku_clue_count_is_configurable(clues: int) -> None:
    for inst in SudokuTask(clues=clues).instances(10, seed=1, split="eval"):
        assert sum(ch != "." for ch in inst.meta["puzzle"]) == clues
        assert count_solutions(inst.meta["puzzle"]) == 1


def test_sudoku_rejects_bad_clues() -> None:
    with pytest.raises(ValueError, match="clues"):
        SudokuTask(clues=10)
    with pytest.raises(ValueError, match="clues"):
        SudokuTask(clues=82)


def test_count_solutions_detects_multiple_and_none() -> None:
    assert count_solutions("." * 81) == 2
    sol = get_task("sudoku").instances(1, seed=0, split="train")[0].reference
    assert count_solutions(sol) == 1
    bad = "11" + sol[2:]
    assert count_solutions(bad) == 0


def test_sudoku_verifier_alternative_solutions_only_when_consistent() -> None:
    task = get_task("sudoku")
    inst = task.instances(1, seed=3, split="eval")[0]
    ref = inst.reference
    swap = str.maketrans("12", "21")
    alt = ref.translate(swap)  # relabelling two digits keeps a valid grid
    assert is_valid_solution("." * 81, alt) and alt != ref
    # The generated puzzle has 1s and 2s among its givens -> the relabelled grid contradicts it.
    assert task.score(inst, alt) == 0.0
    # A hand-made puzzle without any given 1 or 2 has both grids as solutions.
    loose = "".join("." if ch in "12" else ch for ch in ref)
    assert count_solutions(loose) == 2
    loose_inst = Instance(f"sudoku:{loose}=", ref)  # no meta: the scorer parses the prompt
    assert task.score(loose_inst, ref) == 1.0
    assert task.score(loose_inst, alt) == 1.0
    assert task.score(loose_inst, alt + "\n") == 1.0
    # Invalid grids, wrong lengths, non-digits and other puzzles' solutions are rejected.
    k = inst.meta["puzzle"].index(".")
    wrong = ref[:k] + str(int(ref[k]) % 9 + 1) + ref[k + 1 :]
    other = task.instances(2, seed=4, split="eval")[1].reference
    bads = [wrong, ref[:80], ref + "1", ref.replace(ref[0], "0"), ref[:40] + "." + ref[41:]]
    for bad in [*bads, other, ""]:
        assert task.score(inst, bad) == 0.0, bad


# ----------------------------------------------------------------------------- tiesort / either
def _brute_valid_tiesort(items: list[str]) -> set[str]:
    """Every valid answer, by enumerating the orders inside each tie group (an independent check)."""
    from itertools import permutations, product

    groups = [[it for it in items if it[1] == d] for d in sorted({it[1] for it in items})]
    return {",".join(x for part in combo for x in part) for combo in product(*(list(permutations(g)) for g in groups))}


def test_tiesort_accepts_exactly_the_valid_orders() -> None:
    task = get_task("tiesort", min_len=5, max_len=6, digits=2)
    for inst in task.instances(20, seed=3, split="eval"):
        items = inst.meta["items"]
        valid = _brute_valid_tiesort(items)
        assert len(valid) >= 2 and inst.reference in valid  # several correct answers
        for answer in valid:
            assert task.score(inst, answer) == 1.0
        rng = random.Random(0)
        for _ in range(30):  # random permutations: valid iff in the brute-force set
            perm = rng.sample(items, len(items))
            assert task.score(inst, ",".join(perm)) == float(",".join(perm) in valid)


@pytest.mark.parametrize("mutate", [
    lambda a: a.replace(",", ";"),                       # wrong separator
    lambda a: a + "," + a.split(",")[0],                 # an item twice
    lambda a: ",".join(a.split(",")[:-1]),               # an item missing
    lambda a: a[:1].upper() + a[1:],                     # an item not in the prompt
    lambda a: ",".join(reversed(a.split(","))),          # digits decreasing
    lambda a: "",                                        # empty
    lambda a: "\x00<|mask|>" * 3,                        # garbage
])
def test_tiesort_rejects_invalid_answers(mutate) -> None:
    task = get_task("tiesort")
    for inst in task.instances(10, seed=1, split="eval"):
        if len({it[1] for it in inst.meta["items"]}) < 2:
            continue  # one tie group: reversed is still valid
        assert task.score(inst, mutate(inst.reference)) == 0.0


def test_either_accepts_both_strings_and_nothing_else() -> None:
    task = get_task("either")
    insts = task.instances(50, seed=2, split="eval")
    assert {i.reference == i.meta["options"][0] for i in task.instances(50, seed=2, split="train")} == {True, False}
    for inst in insts:
        a, b = inst.meta["options"]
        assert 24 <= len(a) == len(b) <= 32 and sum(x != y for x, y in zip(a, b)) >= 2
        assert task.score(inst, a) == task.score(inst, b) == 1.0
        first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        mixed = a[: first + 1] + b[first + 1 :]  # a's choice at the first difference, b's after
        for bad in (mixed, a[:-1], a + "x", a.upper(), "", "|".join((a, b))):
            assert task.score(inst, bad) == 0.0
        # marked (the default): shared positions lowercase, differing ones uppercase in a, digits in b
        for x, y in zip(a, b):
            assert (x == y and x.islower()) or (x.isupper() and y.isdigit()), (a, b)


def test_unmarked_either_differs_by_lowercase_letters() -> None:
    task = get_task("either", marked=False)
    for inst in task.instances(50, seed=2, split="eval"):
        a, b = inst.meta["options"]
        assert (a + b).islower() and (a + b).isalpha() and sum(x != y for x, y in zip(a, b)) >= 2
        assert task.score(inst, a) == task.score(inst, b) == 1.0


def test_pick_accepts_every_chunkwise_choice_and_nothing_else() -> None:
    from itertools import product

    task = get_task("pick", min_chunks=2, max_chunks=4)
    for inst in task.instances(30, seed=4, split="eval"):
        a, b = (s.split(".") for s in inst.meta["options"])
        assert len(a) == len(b) and 2 <= len(a) <= 4
        for x, y in zip(a, b):  # each chunk differs somewhere; shared lowercase, uppercase vs digit
            assert len(x) == len(y) and x != y
            assert all((p == q and p.islower()) or (p.isupper() and q.isdigit()) for p, q in zip(x, y))
        valid = {".".join(c) for c in product(*zip(a, b))}  # all 2^K answers, enumerated independently
        assert inst.reference in valid and len(valid) == 2 ** len(a)
        for answer in valid:
            assert task.score(inst, answer) == 1.0
        i = next(k for k, (p, q) in enumerate(zip(a[0], b[0])) if p != q)
        mixed = a[0][:i] + b[0][i] + a[0][i + 1:]  # one differing character from the other string
        if mixed not in (a[0], b[0]):
            assert task.score(inst, ".".join([mixed, *a[1:]])) == 0.0
        for bad in (".".join(a[:-1]), ".".join(a) + ".", "".join(a), ".".join(a).upper(), "",
                    ".".join(a) + "." + b[-1], "|".join(inst.meta["options"])):
            assert task.score(inst, bad) == 0.0, bad


def test_tiesort_default_lists_have_9_to_12_items() -> None:
    """The shipped v2 testbed's card is measured on these lengths (answers of 26-35 characters)."""
    task = get_task("tiesort")
    counts = {len(i.meta["items"]) for i in task.instances(200, seed=0, split="eval")}
    assert counts == {9, 10, 11, 12} and task.answer_length == 35


def test_new_tasks_have_long_answers_and_chance_zero() -> None:
    for name in ("tiesort", "either", "pick"):
        task = get_task(name)
        assert 24 <= task.answer_length <= 96
        assert task.chance_score(n=300) == 0.0


@pytest.mark.parametrize("name", ["either", "pick", "tiesort"])
def test_alternative_is_another_correct_answer_of_the_same_length(name) -> None:
    task = get_task(name)
    rng = random.Random(0)
    seen = set()
    for inst in task.instances(300, 4, "train"):
        alt = task.alternative(inst, rng)
        if alt is None:  # tiesort without ties
            assert name == "tiesort" and len({it[1] for it in inst.reference.split(",")}) == len(inst.reference.split(","))
            continue
        assert task.score(inst, alt) == 1.0 and alt != inst.reference and len(alt) == len(inst.reference)
        seen.add((inst.reference, alt))
    assert len(seen) > 250


def test_pick_alternative_flips_whole_chunks_at_random() -> None:
    task = get_task("pick")
    rng = random.Random(1)
    flipped = []
    for inst in task.instances(200, 0, "train"):
        ref, alt = inst.reference.split("."), task.alternative(inst, rng).split(".")
        flipped += [r != a for r, a in zip(ref, alt)]
    assert 0.5 < sum(flipped) / len(flipped) < 0.7  # a fair coin per chunk, plus one forced flip


@pytest.mark.parametrize("name", ["add", "sort", "sudoku"])
def test_single_answer_tasks_have_no_alternative(name) -> None:
    task = get_task(name)
    assert all(task.alternative(i, random.Random(0)) is None for i in task.instances(5, 0, "train"))
