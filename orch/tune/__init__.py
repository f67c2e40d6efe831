"""`orch tune`: the search over plans (search), its trials, the tracked
result table (result, tracking) and the plan file a tune writes for
`orch train` to read (plan_file)."""
