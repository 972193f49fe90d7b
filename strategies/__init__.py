"""Built-in strategies, one algorithm per file. Importing this package registers them all
(it is the ``builtin`` entry point of the ``dlm_toolkit.strategies`` group)."""

from strategies import (  # noqa: F401  (imported to register)
    blocks_multi_block_edit,
    blocks_semi_ar,
    m2t_threshold,
    m2t_topk,
    remask_none,
    t2t_none,
    t2t_threshold,
)
