"""Training a DFlash 2 drafter, one stage per module, in the order the data flows:

    data      regenerated (prompt, response) ids -> train / dev split
    model     the drafter to train: sized from the target, warm-started, or initialised from its layers
    features  the frozen target's context features and teacher top-k, stored once and memory-mapped
    batches   length-bucketed, resumable batch order; padded id and feature tensors
    loss      block cross-entropy (draft vocabulary), distillation, acceptance weighting, selector term
    evaluate  per-position recall and acceptance length (random anchors and on-policy)
    loop      the optimiser loop: checkpoints, resume, CPU-time budget (``python -m dflash2_tools.train``)
    export    a checkpoint -> a Hub-ready drafter folder
"""
