"""9x9 Sudoku: ``"sudoku:<81 chars, '.' = blank>="`` -> the 81-digit solution.

Generator (pure Python, seeded, no external tools): fill a random complete grid with a
randomised bitmask DFS, then visit the cells in random order and blank each one whose removal
keeps the solution unique, until ``clues`` givens remain (restarting with a new order, then a new
grid, if the greedy pass gets stuck). Uniqueness after blanking cell ``c`` (value ``v``) holds iff
no solution has ``c != v``; that is checked with the same DFS (most-constrained cell first,
row/column/box bitmasks), with a free fast path when ``c``'s peers already force ``v``.
Every puzzle therefore has exactly one solution.

Difficulty is set by ``clues``: the default 40 givens (41 blanks) gives puzzles that
*parallel naked-single propagation* almost always solves in a handful of rounds (each round,
fill every blank that has exactly one candidate), the regime where a tiny diffusion model that
commits confident cells in parallel has a chance. ``meta["naked_single_rounds"]`` records that
number of rounds per puzzle (``-1`` if naked singles alone get stuck, i.e. hidden singles or
search are needed); fewer clues mean more rounds and more stuck puzzles. Measured on 300
generated puzzles per row (generation time on one CPU core, CPython 3.11):

=======  =============  ===========  ===========  ====================
 clues    median rounds  max rounds   stuck (-1)   generation
=======  =============  ===========  ===========  ====================
 45       4              10           0 %          ~1 ms / puzzle
 40       6              13           3 %          ~2 ms / puzzle
 36       8              16           15 %         ~2 ms / puzzle
 30       13             19           74 %         ~4 ms / puzzle
 27       17             19           94 %         ~5 ms / puzzle
 24       16             20           97 %         ~25 ms / puzzle
=======  =============  ===========  ===========  ====================

Scoring is 1.0 iff the completion (trailing whitespace stripped) is 81 digits 1-9 forming a
valid complete grid that agrees with every given -- it need not equal the reference (our
puzzles are unique, but the scorer also handles hand-made puzzles with several solutions).
"""

from __future__ import annotations

import random

from .base import Instance, Split, Task, int_option, split_of

__all__ = [
    "SudokuTask",
    "count_solutions",
    "generate_puzzle",
    "is_valid_solution",
    "naked_single_rounds",
]

PREFIX = "sudoku:"
MIN_CLUES = 24
_ALL = 0x1FF
_ROW = [i // 9 for i in range(81)]
_COL = [i % 9 for i in range(81)]
_BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(81)]
_POP = [bin(m).count("1") for m in range(512)]
_DIGITS_OF = [[d + 1 for d in range(9) if m >> d & 1] for m in range(512)]
_UNITS = (
    [[r * 9 + c for c in range(9)] for r in range(9)]
    + [[r * 9 + c for r in range(9)] for c in range(9)]
    + [
        [(b // 3) * 27 + (b % 3) * 3 + r * 9 + c for r in range(3) for c in range(3)]
        for b in range(9)
    ]
)
_PEERS = [sorted({j for u in _UNITS if i in u for j in u} - {i}) for i in range(81)]


# --------------------------------------------------------------------------- solver
class _Board:
    """Row/column/box digit masks plus the list of blank cells of a partial grid."""

    __slots__ = ("cells", "rows", "cols", "boxes", "empties", "ok")

    def __init__(self, cells: list[int]) -> None:
        self.cells = list(cells)
        self.rows = [0] * 9
        self.cols = [0] * 9
        self.boxes = [0] * 9
        self.empties: list[int] = []
        self.ok = True
        for i, v in enumerate(self.cells):
            if v == 0:
                self.empties.append(i)
                continue
            bit = 1 << (v - 1)
            r, c, b = _ROW[i], _COL[i], _BOX[i]
            if (self.rows[r] | self.cols[c] | self.boxes[b]) & bit:
                self.ok = False  # two equal givens in one unit
            self.rows[r] |= bit
            self.cols[c] |= bit
            self.boxes[b] |= bit

    def search(
        self,
        limit: int,
        restrict: dict[int, int] | None = None,
        rng: random.Random | None = None,
    ) -> tuple[int, list[int] | None]:
        """Count solutions up to ``limit``; also return the first one found.

        ``restrict`` maps cell -> allowed-digit mask; ``rng`` randomises the digit order.
        """
        if not self.ok:
            return 0, None
        rows, cols, boxes = self.rows, self.cols, self.boxes
        cells, empties = self.cells, self.empties
        restrict = restrict or {}
        found: list[list[int]] = []
        count = 0

        def dfs(n_empty: int) -> bool:  # returns True when the limit is reached
            nonlocal count
            if n_empty == 0:
                count += 1
                if not found:
                    found.append(list(cells))
                return count >= limit
            best_k, best_mask, best_n = -1, 0, 10
            for k in range(n_empty):
                i = empties[k]
                m = _ALL & ~(rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]])
                if i in restrict:
                    m &= restrict[i]
                n = _POP[m]
                if n < best_n:
                    best_k, best_mask, best_n = k, m, n
                    if n <= 1:
                        break
            if best_n == 0:
                return False
            i = empties[best_k]
            last = n_empty - 1
            empties[best_k], empties[last] = empties[last], empties[best_k]
            r, c, b = _ROW[i], _COL[i], _BOX[i]
            digits = _DIGITS_OF[best_mask]
            if rng is not None and len(digits) > 1:
                digits = digits[:]
                rng.shuffle(digits)
            done = False
            for d in digits:
                bit = 1 << (d - 1)
                rows[r] |= bit
                cols[c] |= bit
                boxes[b] |= bit
                cells[i] = d
                done = dfs(last)
                rows[r] ^= bit
                cols[c] ^= bit
                boxes[b] ^= bit
                cells[i] = 0
                if done:
                    break
            empties[best_k], empties[last] = empties[last], empties[best_k]
            return done

        dfs(len(empties))
        return count, (found[0] if found else None)


def count_solutions(grid: str | list[int], limit: int = 2) -> int:
    """Number of solutions of ``grid``, counted up to ``limit``.

    ``grid`` is 81 characters (``.`` or ``0`` = blank) or 81 ints (``0`` = blank).
    """
    return _Board(_to_cells(grid)).search(limit)[0]


def _random_solution(rng: random.Random) -> list[int]:
    _, sol = _Board([0] * 81).search(1, rng=rng)
    assert sol is not None
    return sol


def _still_unique_without(cells: list[int], c: int, v: int) -> bool:
    """``cells`` (with cell ``c`` now blank) had a unique solution with ``c == v``; is it unique?"""
    peers_mask = 0
    for j in _PEERS[c]:
        if cells[j]:
            peers_mask |= 1 << (cells[j] - 1)
    others = _ALL & ~peers_mask & ~(1 << (v - 1))
    if not others:
        return True  # the peers force v
    count, _ = _Board(cells).search(1, restrict={c: others})
    return count == 0


def generate_puzzle(
    rng: random.Random, clues: int, solution: list[int] | None = None, max_restarts: int = 20
) -> tuple[str, str] | None:
    """A unique-solution puzzle with exactly ``clues`` givens: ``(puzzle, solution)`` strings.

    ``solution`` fixes the full grid (default: a fresh random one). Returns ``None`` if
    ``max_restarts`` greedy passes over that grid all got stuck above ``clues`` givens.
    """
    sol = solution if solution is not None else _random_solution(rng)
    for _ in range(max_restarts):
        cells = list(sol)
        givens = 81
        order = list(range(81))
        rng.shuffle(order)
        for c in order:
            if givens == clues:
                break
            v = cells[c]
            cells[c] = 0
            if _still_unique_without(cells, c, v):
                givens -= 1
            else:
                cells[c] = v
        if givens == clues:
            return _to_str(cells), _to_str(sol)
    return None


def naked_single_rounds(puzzle: str) -> int:
    """Rounds of parallel naked-single filling that solve ``puzzle``; ``-1`` if they get stuck."""
    cells = _to_cells(puzzle)
    rounds = 0
    while True:
        board = _Board(cells)
        if not board.empties:
            return rounds
        fills = []
        for i in board.empties:
            m = _ALL & ~(board.rows[_ROW[i]] | board.cols[_COL[i]] | board.boxes[_BOX[i]])
            if _POP[m] == 1:
                fills.append((i, _DIGITS_OF[m][0]))
        if not fills:
            return -1
        for i, d in fills:
            cells[i] = d
        rounds += 1


def is_valid_solution(puzzle: str, answer: str) -> bool:
    """Whether ``answer`` is 81 digits 1-9 forming a valid grid that keeps ``puzzle``'s givens."""
    if len(answer) != 81 or len(puzzle) != 81 or not all("1" <= ch <= "9" for ch in answer):
        return False
    if any(p not in ".0" and p != a for p, a in zip(puzzle, answer)):
        return False
    full = set("123456789")
    return all({answer[i] for i in unit} == full for unit in _UNITS)


def _to_cells(grid: str | list[int]) -> list[int]:
    if isinstance(grid, str):
        if len(grid) != 81:
            raise ValueError(f"a sudoku grid has 81 cells, got {len(grid)} characters")
        return [0 if ch in ".0" else int(ch) for ch in grid]
    if len(grid) != 81:
        raise ValueError(f"a sudoku grid has 81 cells, got {len(grid)}")
    return list(grid)


def _to_str(cells: list[int]) -> str:
    return "".join(str(v) if v else "." for v in cells)


# --------------------------------------------------------------------------- task
class SudokuTask(Task):
    """Solve a 9x9 Sudoku with exactly ``clues`` givens and a unique solution.

    Prompt ``"sudoku:" + 81 chars ('.' = blank, row-major) + "="``; reference = the 81-digit
    solution; ``answer_length`` = 81. See the module docstring for generator and difficulty.
    The train/eval canonical key is the *solution grid*, so an eval solution never appears in
    training, not even with different blanks.

    Args:
        clues: number of givens, 24..81 (default 40). Generation slows below ~27 givens
            (greedy removal more often gets stuck at a minimal puzzle and restarts); below 24
            it fails too often to be supported.
    """

    name = "sudoku"
    description = "solve a 9x9 sudoku (unique solution, `clues` givens)"
    metric_name = "valid_solution"
    answer_alphabet = "123456789"
    answer_length = 81

    def __init__(self, clues: int = 40) -> None:
        self.clues = int_option(self.name, "clues", clues, MIN_CLUES, 81)

    def _sample(self, rng: random.Random, split: Split) -> Instance | None:
        solution = _random_solution(rng)
        if split_of(_to_str(solution)) != split:
            return None  # reject before the (costlier) clue removal
        made = generate_puzzle(rng, self.clues, solution=solution)
        if made is None:
            return None
        puzzle, sol = made
        return Instance(
            prompt=f"{PREFIX}{puzzle}=",
            reference=sol,
            meta={
                "puzzle": puzzle,
                "clues": self.clues,
                "naked_single_rounds": naked_single_rounds(puzzle),
            },
        )

    def canonical_key(self, instance: Instance) -> str:
        return instance.reference

    @staticmethod
    def puzzle_of(instance: Instance) -> str:
        """The 81-character puzzle of ``instance`` (from ``meta`` or parsed from the prompt)."""
        puzzle = instance.meta.get("puzzle")
        if puzzle is None:
            puzzle = instance.prompt.removeprefix(PREFIX).rstrip("=")
        return puzzle

    def score(self, instance: Instance, completion: str) -> float:
        return float(is_valid_solution(self.puzzle_of(instance), completion.rstrip()))

    def random_guess(self, instance: Instance, rng: random.Random) -> str:
        """Keep the givens, fill each blank with a uniformly random digit."""
        return "".join(
            ch if ch != "." else rng.choice(self.answer_alphabet) for ch in self.puzzle_of(instance)
        )

    def __repr__(self) -> str:
        return f"SudokuTask(clues={self.clues})"
