"""Names and ids checked by a regular expression match the whole string: Python's `$` also
matches before a final newline, so `^...$` with `re.match` let "name\n" through (a template
`_nl\n` was made, a state `sx\n` uploaded; QA)."""

from __future__ import annotations

import pytest

from server.api.openai import tools
from server.api.responses.render import task_id
from server.model.state_file import StateFileError, state_from_dict
from server.model.synthetic import PRESETS
from server.tasks import imports, templates
from server.tasks.errors import TaskInvalid

TRAILING = ["nl\n", "nl\r\n", "\nnl", " nl"]


@pytest.mark.parametrize("name", TRAILING)
def test_template_and_state_names_refuse_a_trailing_newline(name):
    with pytest.raises(TaskInvalid):
        templates.check_name(name)
    with pytest.raises(TaskInvalid):
        imports.check_name(name)
    templates.check_name(name.strip())  # the same name without it is fine
    assert imports.check_name(name.strip()) == "_nl"


def test_a_tool_name_with_a_trailing_newline_is_refused():
    fn = {"type": "function", "function": {"name": "get\n", "parameters": {"type": "object"}}}
    with pytest.raises(tools.ToolError, match="a tool name is"):
        tools.plan([fn], "auto", None)
    fn["function"]["name"] = "get"
    assert tools.plan([fn], "auto", None) is not None


def test_a_response_id_with_a_trailing_newline_is_no_response_id():
    rid = "resp_" + "0" * 32
    assert task_id(rid) == "TASK_" + "0" * 32
    assert task_id(rid + "\n") is None


def test_a_state_key_with_a_trailing_newline_is_unexpected():
    import torch

    shape = PRESETS["tiny"]
    sd = {f"blocks.{i}.att.time_state": torch.zeros(shape.n_head, shape.head_size, shape.head_size)
          for i in range(shape.n_layer)}
    state_from_dict(sd, shape, source="s")
    sd["blocks.0.att.time_state\n"] = sd.pop("blocks.0.att.time_state")
    with pytest.raises(StateFileError, match="unexpected key"):
        state_from_dict(sd, shape, source="s")
