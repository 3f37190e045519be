"""Training recipes written against the public SDK only (`import tuneloop`).

They are examples a user can copy: the loop runs in this process, the server does the model
work. `tuneloop demo` (tuneloop.recipes.demo) is the first.
"""
