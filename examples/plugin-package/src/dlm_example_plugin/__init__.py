"""An example dlm-toolkit strategy plug-in: a rule (``rules.py``, ``tests/test_rule.py``) and a step hook
with a parameter (``hooks.py``, ``tests/test_hook.py``)."""
