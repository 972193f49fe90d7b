"""Built-in strategies, one algorithm per file. Importing this package registers them all
(it is the ``builtin`` entry point of the ``dlm_toolkit.strategies`` group)."""

from strategies import (  # noqa: F401  (imported to register)
    blocks_multi_block_edit,
    blocks_semi_ar,
    m2t_ancestral,
    m2t_credit,
    m2t_dus,
    m2t_entropy,
    m2t_entropy_bound,
    m2t_factor,
    m2t_hierarchy,
    m2t_klass,
    m2t_learned,
    m2t_margin,
    m2t_pc_sampler,
    m2t_s2d2,
    m2t_threshold,
    m2t_topk,
    remask_low_confidence,
    remask_none,
    remask_remdm,
    remask_t2m,
    t2t_margin,
    t2t_none,
    t2t_threshold,
    wino,
)
