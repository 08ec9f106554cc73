"""GLM's output markup: ``<think>`` reasoning (glm45) and ``<tool_call>`` / ``<arg_key>`` / ``<arg_value>`` calls (glm47)."""
