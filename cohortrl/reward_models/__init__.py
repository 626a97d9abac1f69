"""Learned reward models: labelled data for them (``labels``: JSONL files, the gym's perturbed references,
Math-Shepherd rollouts), training an ORM or a PRM (``train``, ``cohortrl train-rm``), loading and scoring one
(``scoring``: `load_prm`, `prm_step_scores`, `orm_scores`), judging it (``evaluate``: step accuracy, AUROC,
best-of-N), and PRIME's implicit PRM, learned online from the policy (``implicit_prm``).

Nothing is imported here: each module loads torch or transformers only when used. Layer 3, beside `rewards`
and `rollout`: `rewards` uses these models as reward functions and step sources (``reward_model``,
``learned_prm``, ``implicit_prm``), so nothing here imports `rewards`.
"""
