"""Chat workloads for speculative decoding's acceptance (issue 30): three whose answers repeat
their context (rewrite a code snippet with one change, summarise a passage quoting it, a
multi-turn chat that asks for a restatement) and one whose answers do not. Imported by
``speculative_acceptance.py`` (the CPU) and ``speculative_served.py`` (the served engine)."""

from __future__ import annotations

CODE = [
    '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    averages = []
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages''',
    '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count=1):
        if count < 0:
            raise ValueError("count must not be negative")
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count=1):
        available = self.items.get(name, 0)
        if count > available:
            raise KeyError(f"only {available} of {name} left")
        self.items[name] = available - count

    def total(self):
        return sum(self.items.values())''',
    '''def parse_config(lines):
    config = {}
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected key = value")
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config''',
]
CODE_EDITS = ["rename the variable `total` to `running_sum`", "rename the method `total` to `count_all`",
              "rename the variable `config` to `settings`"]

PASSAGES = [
    "The lighthouse at Point Reyes was built in 1870 and sits on a ledge three hundred feet above the "
    "Pacific. Its first-order Fresnel lens, made in France, was carried up the cliff in pieces and assembled "
    "by hand. For more than a century keepers climbed three hundred steps every evening to wind the clockwork "
    "that turned the lens. The fog here is among the thickest on the coast, and the keepers' logs record weeks "
    "without a clear sky. In 1975 an automated light replaced the old lens, which still turns for visitors on "
    "special occasions.",
    "Honeybees communicate the location of food with a waggle dance. A forager returning to the hive runs "
    "straight ahead while shaking her body, then circles back and repeats. The angle of the straight run "
    "relative to vertical matches the angle between the food and the sun, and the length of the run tells "
    "the distance. Other bees follow the dancer and then fly out to find the flowers themselves. Karl von "
    "Frisch decoded the dance in the 1940s and shared the Nobel Prize for it in 1973.",
]

ANSWERS = [
    ("How do I keep basil alive indoors?",
     "Give basil at least six hours of bright light a day, ideally on a south-facing windowsill. Water it when "
     "the top inch of soil is dry, and make sure the pot drains well, because soggy roots rot quickly. Pinch "
     "off the top leaves regularly so the plant grows bushy instead of tall, and remove any flower buds as "
     "soon as they appear."),
    ("What is the difference between weather and climate?",
     "Weather is what the atmosphere is doing at a given place and time: today's temperature, rain or wind. "
     "Climate is the pattern of weather over a long period, usually thirty years or more, such as the average "
     "summer temperature of a region or how much rain it gets in a typical year. Weather changes by the hour, "
     "while climate changes over decades."),
]

OPEN_ENDED = ["Write a short story about a robot who learns to paint.",
              "Give me five ideas for a rainy Saturday afternoon with children.",
              "Explain why the sky is blue to a ten-year-old."]


def workloads() -> dict[str, list[list[dict]]]:
    """Each workload's conversations (chat messages, the user's turn last)."""
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    return {
        "code_edit": [[user(f"Here is some Python code:\n\n```python\n{code}\n```\n\nRewrite the code and "
                            f"{edit}. Change nothing else and reply with the complete code only.")]
                      for code, edit in zip(CODE, CODE_EDITS)],
        "summary_quote": [[user(f"Read this passage:\n\n{text}\n\nSummarise it in two sentences, then quote its "
                                "first two sentences exactly.")] for text in PASSAGES],
        "multi_turn_restate": [[user(question), {"role": "assistant", "content": answer},
                                user("Please repeat your previous answer word for word, then add one more tip.")]
                               for question, answer in ANSWERS],
        "open_ended": [[user(text)] for text in OPEN_ENDED],
    }
