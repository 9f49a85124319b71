"""The SGLang rollout engine: a client of SGLang servers' native HTTP API.

One idea a module; import from the module that holds a name (this package exports nothing):

- `client`: `SGLangEngine`, the `RolloutEngine` itself: `generate`, HTTP retries, the private
  event loop;
- `schema`: the `/generate` request bodies and how an answer becomes a `Generation` (token ids,
  finish reasons, log-probs), and the per-sample seeds (`sample_seed`, `split_sample_seed`);
- `fleet`: the worker servers and the router: URLs, health waiting, which server gets a request;
- `weights`: weight updates, weight versions (`checkpoint_weight_version`) and the check that
  servers return raw log-probs;
- `errors`: the client's errors (`SGLangError` and its subclasses).

`docs/sglang.md` describes what the client sends and checks.
"""
