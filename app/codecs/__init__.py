"""Protocols as codecs: pure functions between the core's types and each protocol's requests and responses.

`predict`: `POST /predict` and `/v1` JSON. `v2`: the Open Inference Protocol's tensors. They import
the core and pydantic, never a web framework.
"""
