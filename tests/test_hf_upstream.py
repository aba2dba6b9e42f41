"""The private names of transformers / TRL / accelerate the integration relies on (integrations/hf_upstream.py):
each is still there in the installed releases, and the list is complete for the methods the trainers override
(a private method overridden without being listed fails here). No ranks: imports and class attributes only."""

from cp_handler.integrations import hf_rl_trainer, hf_trainer
from cp_handler.integrations.hf_upstream import CHECKED_AGAINST, PRIVATE_NAMES, PrivateName, missing

TRAINERS = {"CPTrainer": hf_trainer, "CPSFTTrainer": hf_trainer, "CPGRPOTrainer": hf_rl_trainer,
            "CPRLOOTrainer": hf_rl_trainer, "CPDPOTrainer": hf_rl_trainer}


def overridden_private_methods() -> set[tuple[str, str]]:
    """``(upstream class, name)`` of every single-underscore method a CP trainer class defines in cp_handler's code
    whose upstream base class defines it too."""
    found = set()
    for name, module in TRAINERS.items():
        cls = getattr(module, name)
        ours = [k for k in cls.__mro__ if k.__module__.startswith("cp_handler")]
        theirs = [k for k in cls.__mro__ if not k.__module__.startswith("cp_handler") and k is not object]
        for attribute in {a for k in ours for a in vars(k) if a.startswith("_") and not a.startswith("__")}:
            owner = next((k for k in theirs if attribute in vars(k)), None)
            if owner is not None:
                found.add((f"{owner.__module__.split('.')[0]}.{owner.__name__}", attribute))
    return found


def test_every_private_name_is_still_there():
    assert not missing(), f"upstream changed what cp_handler relies on (listed in integrations/hf_upstream.py): " \
                          f"{missing()}"


def test_every_overridden_private_method_is_listed():
    listed = {(n.owner, n.name) for n in PRIVATE_NAMES if n.use == "overridden"}
    found = overridden_private_methods()
    assert found, "the scan found no override: it is broken"
    assert found <= listed, f"private methods overridden but not listed in integrations/hf_upstream.py: " \
                            f"{sorted(found - listed)}"
    assert listed <= found, f"listed as overridden but not overridden (stale): {sorted(listed - found)}"


def test_a_name_upstream_lacks_is_reported():
    """Negative control: a method, an attribute and a module global that do not exist, and a method whose
    parameters changed, are each reported, with the releases the list was checked against."""
    fake = (PrivateName("trl.GRPOTrainer", "_no_such_method", "overridden", "x"),
            PrivateName("trl.trainer.sft_trainer", "_no_such_attribute", "attribute", "x"),
            PrivateName("trl.trainer.grpo_trainer", "no_such_global", "module global", "x"),
            PrivateName("trl.NoSuchTrainer", "_compute_loss", "overridden", "x"),
            PrivateName("trl.DPOTrainer", "_compute_loss", "overridden", "x", ("self", "model", "batch")))
    reported = missing(fake)
    assert len(reported) == 5 and all(CHECKED_AGAINST in line for line in reported), reported
    assert "parameters now ('self', 'model', 'inputs', 'return_outputs')" in reported[-1], reported[-1]
    assert not missing(PRIVATE_NAMES[:1])
