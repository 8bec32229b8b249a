"""The vocabulary every other part speaks: a case, where a probe runs (coordinates), memory layouts,
recipes, the errors that reach the user (and reading a document without a traceback), and the child
processes attn-doctor starts."""
