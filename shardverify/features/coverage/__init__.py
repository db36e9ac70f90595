"""How much of an op set the shipped specs serve: `core_aten` accounts for every Core ATen
overload of the pinned torch (a spec, a stated reason, or "no spec yet")."""
