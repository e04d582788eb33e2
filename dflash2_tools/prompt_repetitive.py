"""A repetitive workload: what people send one model many times (issue 39's benchmark for suffix drafting).

Four templates, 12 requests each, interleaved in a fixed order (48 requests): structured extraction from different
records, edits of one Python file, a tool-calling turn, and a templated status report. Every field comes from fixed
lists, so the set is the same on every machine; the target's own greedy answers are what the benchmark
(``python -m dflash2_tools.bench_suffix``) records and checks every method against.
"""

from __future__ import annotations

NAMES = ["Alice Moreau", "Bilal Hassan", "Chen Wei", "Dana Kowalski", "Emeka Obi", "Farah Nasser", "Goran Petrovic",
         "Hana Sato", "Ivan Novak", "Julia Costa", "Kofi Mensah", "Lena Fischer"]
CITIES = ["Lyon", "Cairo", "Chengdu", "Krakow", "Lagos", "Amman", "Belgrade", "Osaka", "Zagreb", "Porto", "Accra", "Bremen"]
JOBS = ["nurse", "electrician", "teacher", "architect", "pharmacist", "accountant", "chef", "translator", "pilot",
        "librarian", "carpenter", "engineer"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
PROJECTS = ["billing service", "mobile app", "data pipeline", "search index", "payment gateway", "user dashboard"]
STATUSES = ["on track", "delayed by a week", "blocked on review", "ahead of schedule"]

SOURCE_FILE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    return subtotal * (1 + tax_rate)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best'''

EDITS = ["Rename the function total_price to order_total.", "Add a docstring to each function.",
         "Add type hints to both functions.", "Rename the variable subtotal to amount.",
         "Make cheapest return None explicitly when items is empty.", "Rename the function cheapest to lowest_priced.",
         "Round the result of total_price to 2 decimals.", "Rename the parameter items to products in both functions.",
         "Add a default tax_rate of 0.2 to total_price.", "Rename the variable best to winner.",
         "Use the built-in min function in cheapest.", "Use the built-in sum function in total_price."]


def _extraction(i: int) -> str:
    age = 23 + (i * 7) % 40
    return (f"Extract the person's name, age, city and job from the text below. Answer with a JSON object with the keys "
            f"\"name\", \"age\", \"city\" and \"job\".\n\nText: {NAMES[i]} is a {age}-year-old {JOBS[i]} who lives in {CITIES[i]}.")


def _code_edit(i: int) -> str:
    return f"Here is a Python file:\n\n```python\n{SOURCE_FILE}\n```\n\n{EDITS[i]} Reply with the whole updated file."


def _tool_call(i: int) -> str:
    return ("You can call one tool: get_weather(city: str, day: str). Reply only with a JSON object of the form "
            "{\"tool\": \"get_weather\", \"arguments\": {\"city\": ..., \"day\": ...}}.\n\n"
            f"User: What will the weather be like in {CITIES[(i * 5) % 12]} on {DAYS[i % 6]}?")


def _report(i: int) -> str:
    return ("Write a short status report that follows this template exactly:\n\nProject: <name>\nStatus: <status>\n"
            "Next step: <next step>\nSummary: <one sentence>\n\n"
            f"The project is the {PROJECTS[i % 6]}, it is {STATUSES[i % 4]}, and the next step is "
            f"{['testing', 'a release', 'a design review', 'hiring'][i % 4]}.")


TEMPLATES = {"extraction": _extraction, "code-edit": _code_edit, "tool-call": _tool_call, "report": _report}
REQUESTS_PER_TEMPLATE = 12


def repetitive_prompts() -> list[dict]:
    """48 chat requests, the four templates interleaved (request i of every template, then request i + 1)."""
    return [{"id": f"repetitive/{name}/{i}", "messages": [{"role": "user", "content": make(i)}]}
            for i in range(REQUESTS_PER_TEMPLATE) for name, make in TEMPLATES.items()]


__all__ = ["TEMPLATES", "repetitive_prompts"]
