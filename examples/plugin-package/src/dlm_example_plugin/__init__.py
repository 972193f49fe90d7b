"""An example dlm-toolkit strategy plug-in (see ``rules.py`` and ``tests/test_rule.py``)."""
