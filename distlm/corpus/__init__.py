"""The offline prepare pipeline: documents in, token shards and ``manifest.json`` out.

``prepare.py`` holds the entry points (``prepare``, ``merge``); the rest is split by idea
(see its docstring). It sits above ``distlm.data``, whose readers of a prepared folder,
shard format and tokenizers it uses; nothing that trains or reads a prepared folder imports
it. Empty on purpose: a tokenizer worker process imports only ``pool`` and ``worker``.
"""
