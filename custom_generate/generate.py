"""DFlash 2 as a transformers ``custom_generate`` recipe.

    out = target.generate(**inputs, custom_generate=REPO, trust_remote_code=True,
                          assistant_model=drafter, max_new_tokens=256)

REPO is this repository (a Hub id or a local folder). Behaviour is the same as the plain
``target.generate(**inputs, assistant_model=drafter)`` call; add ``return_dflash2_stats=True``
to get ``(output, DFlash2Stats)`` back. The drafter's own modules (loaded by
``AutoModel.from_pretrained(REPO, trust_remote_code=True)``) carry the implementation, so
this file stays a thin entry point.
"""

import sys

from transformers.generation.utils import GenerationMixin


def generate(model, inputs=None, assistant_model=None, return_dflash2_stats=False, **kwargs):
    if assistant_model is None or not getattr(assistant_model, "_is_dflash2_drafter", False):
        raise ValueError(
            "custom_generate=<DFlash 2 repo> needs the drafter: "
            "drafter = AutoModel.from_pretrained(REPO, trust_remote_code=True); "
            "target.generate(..., custom_generate=REPO, trust_remote_code=True, assistant_model=drafter)"
        )
    modeling = sys.modules[type(assistant_model).__module__]
    kwargs.pop("custom_generate", None)
    generate_kwargs = {k: v for k, v in kwargs.items() if v is not None}
    out, stats = modeling.dflash2_generate(model, assistant_model, inputs, **generate_kwargs)
    return (out, stats) if return_dflash2_stats else out
