"""Agents written in any framework drive episodes over an OpenAI-compatible API (issue 58).

- tokens.py: the token-fidelity rule: a chat rendered with the model's chat template, the check that a
  request's messages extend the episode's conversation, each turn's prompt ids (the previous prompt and the
  sampled completion, then only what the template appended), prefix breaks, what is masked out of the loss,
  and the group's common prompt.
"""
