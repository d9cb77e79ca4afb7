"""The word tables the generic known-answer probes draw from (:mod:`bakeoff.analysis.generic_probes`).

Every entry has one answer a small instruction-tuned model is expected to know and that no other
common answer competes with: well-known capitals only (no Sydney/Canberra or Istanbul/Ankara
trap), languages named one way (no Iran: Persian or Farsi), regular and common irregular
plurals, opposites without a second common answer (no "light": dark or heavy; no "old": new or
young as a key). Answers within a table are distinct, so a few-shot prefix never shows the
answer it asks for.
"""

from __future__ import annotations

# country (as it reads after "The capital of ") -> capital
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "England": "London", "Greece": "Athens",
    "Portugal": "Lisbon", "Austria": "Vienna", "Ireland": "Dublin", "Norway": "Oslo", "Sweden": "Stockholm",
    "Poland": "Warsaw", "Hungary": "Budapest", "the Netherlands": "Amsterdam", "Belgium": "Brussels",
    "Canada": "Ottawa", "Thailand": "Bangkok", "South Korea": "Seoul", "Cuba": "Havana", "Peru": "Lima",
    "Kenya": "Nairobi", "Denmark": "Copenhagen", "Finland": "Helsinki", "Scotland": "Edinburgh",
    "the Czech Republic": "Prague", "Iraq": "Baghdad", "Iran": "Tehran", "Afghanistan": "Kabul",
}

# country (as it reads after "In ") -> the language people speak there
LANGUAGES = {
    "France": "French", "Germany": "German", "Spain": "Spanish", "Italy": "Italian", "Japan": "Japanese",
    "China": "Chinese", "Russia": "Russian", "Greece": "Greek", "Portugal": "Portuguese", "Poland": "Polish",
    "Sweden": "Swedish", "Norway": "Norwegian", "Finland": "Finnish", "Denmark": "Danish", "Turkey": "Turkish",
    "Korea": "Korean", "Thailand": "Thai", "Vietnam": "Vietnamese", "Hungary": "Hungarian",
    "the Netherlands": "Dutch", "England": "English", "Ukraine": "Ukrainian", "Czechia": "Czech",
    "Croatia": "Croatian", "Romania": "Romanian", "Bulgaria": "Bulgarian", "Serbia": "Serbian",
    "Slovakia": "Slovak", "Indonesia": "Indonesian", "Israel": "Hebrew",
}

PLURALS = {
    "cat": "cats", "dog": "dogs", "box": "boxes", "car": "cars", "book": "books", "tree": "trees",
    "house": "houses", "bird": "birds", "apple": "apples", "chair": "chairs", "table": "tables", "cup": "cups",
    "bus": "buses", "dish": "dishes", "church": "churches", "baby": "babies", "city": "cities",
    "party": "parties", "story": "stories", "leaf": "leaves", "knife": "knives", "wolf": "wolves",
    "child": "children", "man": "men", "woman": "women", "mouse": "mice", "foot": "feet", "tooth": "teeth",
    "goose": "geese", "person": "people", "fox": "foxes", "horse": "horses", "pen": "pens", "star": "stars",
    "door": "doors", "window": "windows", "flower": "flowers", "river": "rivers", "lamp": "lamps",
    "shoe": "shoes", "hat": "hats", "glass": "glasses", "brush": "brushes", "watch": "watches", "key": "keys",
    "toy": "toys", "boy": "boys", "girl": "girls", "egg": "eggs", "friend": "friends", "ship": "ships",
    "hand": "hands",
}

OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "day": "night", "fast": "slow", "good": "bad",
    "black": "white", "rich": "poor", "wet": "dry", "early": "late", "full": "empty", "high": "low",
    "in": "out", "left": "right", "long": "short", "strong": "weak", "thick": "thin", "true": "false",
    "win": "lose", "yes": "no", "buy": "sell", "push": "pull", "inside": "outside", "love": "hate",
    "above": "below", "alive": "dead", "cheap": "expensive", "clean": "dirty", "deep": "shallow",
    "friend": "enemy", "heavy": "light", "loud": "quiet", "north": "south", "east": "west",
    "question": "answer", "top": "bottom", "war": "peace", "young": "old", "before": "after", "near": "far",
    "always": "never", "wide": "narrow", "on": "off",
}

MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")

# copy: words of one or two common tokens; kv-recall: three-letter keys
NOUNS = ("apple banana cherry river mountain window candle garden pencil silver orange rabbit violin "
         "castle forest engine planet rocket harbor bottle").split()
KEYS = "cat dog sun car box hat pen cup key map bus egg fox owl tea".split()
