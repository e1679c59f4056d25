"""The embedded search world: a deterministic fictional encyclopedia and questions that need searching.

Everything is invented (names from syllables), so no answer can come from a pretrained prior or from the question
text: the agent has to search. The world has four entity kinds::

    country  -- capital (a city), currency
    city     -- country, river, founding year
    person   -- birth city, birth year, occupation, employer (a company)
    company  -- headquarters (a city), founder (a person), founding year, product

One passage per entity, in Search-R1's wiki-18 format (``contents = '"Title"\\nbody'``), states all its attributes.
Questions come in two kinds:

- single-hop: one attribute of one entity ("In which city was Aldo Venmar born?"); one search on the entity's name
  finds the answer.
- bridge (two-hop): an attribute of an entity reached through another ("In which country was Aldo Venmar born?"
  -> Aldo Venmar's birth city -> that city's country); two searches.

Train/test split: the entities a question names (its *subject*) are partitioned, so a test question never names an
entity any train question names. Answers are attribute values (cities, years, ...) and can recur across splits.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from async_agent_rl.config import WorldConfig
from async_agent_rl.errors import InputError

_ONSETS = ["b", "br", "d", "dr", "f", "g", "k", "kr", "l", "m", "n", "p", "r", "s", "st", "t", "tr", "v", "z", "h"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ei"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "m", "nd", "rk"]

OCCUPATIONS = [
    "painter", "chemist", "architect", "sculptor", "astronomer", "poet", "engineer", "botanist", "composer",
    "cartographer", "physician", "historian", "violinist", "geologist", "economist", "novelist",
]
PRODUCTS = [
    "bicycles", "telescopes", "pianos", "ceramics", "textiles", "lanterns", "clocks", "paper", "glassware",
    "maps", "ink", "rope",
]
CURRENCY_SUFFIX = ["mark", "crown", "florin", "penny", "dinar", "shell"]
RIVER_SUFFIX = "River"
COMPANY_SUFFIX = ["Works", "Industries", "Company", "Guild", "Foundry", "Trading"]


@dataclass
class Entity:
    kind: str
    name: str
    attrs: dict[str, str] = field(default_factory=dict)


@dataclass
class Question:
    question: str
    answers: list[str]
    subject: str  # the entity the question names
    hops: int  # 1 = single-hop, 2 = bridge
    relation: str
    bridge: str = ""  # the intermediate entity of a bridge question

    @property
    def data_source(self) -> str:
        return "world_single" if self.hops == 1 else "world_bridge"


@dataclass
class World:
    entities: dict[str, Entity]
    train: list[Question]
    test: list[Question]

    def passages(self) -> list[dict[str, str]]:
        return passages_of(self.entities)


class _Names:
    """Unique invented words; no generated word is a substring of another (keeps retrieval and EM unambiguous).

    When the words of a length run out (one-syllable first names, past about 450 people), that kind of word gets a
    syllable more from then on; worlds small enough never to run out are generated exactly as before."""

    MAX_EXTRA_SYLLABLES = 3

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()
        self.extra: dict[int, int] = {}  # requested syllables -> syllables added since that length ran out

    def word(self, syllables: int) -> str:
        while True:
            n = syllables + self.extra.get(syllables, 0)
            for _ in range(10_000):
                w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                            for _ in range(n)).capitalize()
                lw = w.lower()
                if any(lw in u or u in lw for u in self.used):
                    continue
                self.used.add(lw)
                return w
            if self.extra.get(syllables, 0) >= self.MAX_EXTRA_SYLLABLES:
                raise InputError(f"the world's names ran out ({len(self.used)} made): lower data.world.num_people, "
                                 "num_cities, num_companies or num_countries")
            self.extra[syllables] = self.extra.get(syllables, 0) + 1


def describe(e: Entity) -> str:
    a = e.attrs
    if e.kind == "country":
        return f"{e.name} is a country. Its capital is {a['capital']}. The currency of {e.name} is the {a['currency']}."
    if e.kind == "city":
        return (
            f"{e.name} is a city in {a['country']}. It was founded in {a['founded']}. "
            f"The {a['river']} flows through {e.name}."
        )
    if e.kind == "person":
        return (
            f"{e.name} is a {a['occupation']} born in {a['birth_year']} in {a['birth_city']}. "
            f"{e.name} works for {a['employer']}."
        )
    if e.kind == "company":
        return (
            f"{e.name} is a company that makes {a['product']}. It was founded in {a['founded']} by {a['founder']} "
            f"and is headquartered in {a['headquarters']}."
        )
    raise ValueError(f"unknown entity kind {e.kind!r}")


# (relation, question template over the subject, attribute of the subject) for single-hop questions
_SINGLE = {
    "person": [
        ("birth_city", "In which city was {s} born", "birth_city"),
        ("birth_year", "In what year was {s} born", "birth_year"),
        ("occupation", "What is the occupation of {s}", "occupation"),
        ("employer", "Which company does {s} work for", "employer"),
    ],
    "city": [
        ("country", "In which country is {s}", "country"),
        ("river", "Which river flows through {s}", "river"),
        ("founded", "In what year was {s} founded", "founded"),
    ],
    "company": [
        ("headquarters", "In which city is {s} headquartered", "headquarters"),
        ("founder", "Who founded {s}", "founder"),
        ("product", "What does {s} make", "product"),
    ],
    "country": [
        ("capital", "What is the capital of {s}", "capital"),
        ("currency", "What is the currency of {s}", "currency"),
    ],
}
# (relation, template, subject attr naming the bridge entity, bridge entity's attribute)
_BRIDGE = {
    "person": [
        ("birth_country", "In which country was {s} born", "birth_city", "country"),
        ("birth_river", "Which river flows through the city where {s} was born", "birth_city", "river"),
        ("employer_hq", "In which city is the employer of {s} headquartered", "employer", "headquarters"),
    ],
    "company": [
        ("hq_country", "In which country is {s} headquartered", "headquarters", "country"),
        ("founder_city", "In which city was the founder of {s} born", "founder", "birth_city"),
        ("founder_occupation", "What is the occupation of the founder of {s}", "founder", "occupation"),
    ],
}


def generate_world(cfg: WorldConfig) -> World:
    rng = random.Random(cfg.seed)
    names = _Names(rng)
    ents: dict[str, Entity] = {}

    countries = [Entity("country", names.word(2) + "ia") for _ in range(cfg.num_countries)]
    cities = [Entity("city", names.word(2)) for _ in range(cfg.num_cities)]
    people = [Entity("person", f"{names.word(1)} {names.word(2)}") for _ in range(cfg.num_people)]
    companies = [Entity("company", f"{names.word(2)} {rng.choice(COMPANY_SUFFIX)}") for _ in range(cfg.num_companies)]

    for i, c in enumerate(cities):
        country = countries[i % len(countries)]
        c.attrs = {
            "country": country.name,
            "river": f"{names.word(2)} {RIVER_SUFFIX}",
            "founded": str(rng.randint(900, 1890)),
        }
    for country in countries:
        own = [c for c in cities if c.attrs["country"] == country.name]
        country.attrs = {
            "capital": rng.choice(own).name,
            "currency": f"{names.word(1).lower()} {rng.choice(CURRENCY_SUFFIX)}",
        }
    for co in companies:
        co.attrs = {
            "headquarters": rng.choice(cities).name,
            "founded": str(rng.randint(1700, 1990)),
            "product": rng.choice(PRODUCTS),
        }
    for p in people:
        p.attrs = {
            "birth_city": rng.choice(cities).name,
            "birth_year": str(rng.randint(1800, 1999)),
            "occupation": rng.choice(OCCUPATIONS),
            "employer": rng.choice(companies).name,
        }
    for co in companies:
        co.attrs["founder"] = rng.choice(people).name
    for e in (*countries, *cities, *people, *companies):
        ents[e.name] = e

    # Partition the subjects: a test question never names an entity a train question names.
    subjects = [e for e in ents.values()]
    rng.shuffle(subjects)
    test_subjects = {e.name for e in subjects[: max(1, round(len(subjects) * cfg.test_fraction))]}

    train: list[Question] = []
    test: list[Question] = []
    for e in ents.values():
        chosen = questions_about(e, ents, rng, cfg.two_hop_fraction)
        (test if e.name in test_subjects else train).extend(chosen)
    rng.shuffle(train)
    rng.shuffle(test)
    return World(ents, train, test)


def questions_about(e: Entity, ents: dict[str, Entity], rng: random.Random, two_hop_fraction: float) -> list[Question]:
    """The questions whose subject is ``e``: all its single-hop ones and a ``two_hop_fraction`` mix of bridges."""
    singles = [Question(f"{t.format(s=e.name)}?", [e.attrs[attr]], e.name, 1, rel) for rel, t, attr in _SINGLE[e.kind]]
    bridges = []
    for rel, t, via, attr in _BRIDGE.get(e.kind, []):
        mid = ents[e.attrs[via]]
        bridges.append(Question(f"{t.format(s=e.name)}?", [mid.attrs[attr]], e.name, 2, rel, bridge=mid.name))
    return _mix(rng, singles, bridges, two_hop_fraction)


def read_entities(world_file: str | Path) -> dict[str, Entity]:
    """The entity table ``write_world`` wrote (``world.json``)."""
    table = json.loads(Path(world_file).read_text())
    return {name: Entity(row["kind"], name, {k: v for k, v in row.items() if k != "kind"}) for name, row in table.items()}


def shuffle_facts(ents: dict[str, Entity], rng: random.Random) -> dict[str, Entity]:
    """A copy of the world with every attribute column permuted among the entities of one kind: the same names in
    the same sentence shapes, no true fact except by chance. A model trained on such copies can only answer by
    reading the passages it retrieves."""
    by_kind: dict[str, list[Entity]] = {}
    for e in ents.values():
        by_kind.setdefault(e.kind, []).append(e)
    out: dict[str, Entity] = {}
    for kind, group in by_kind.items():
        columns = {a: [e.attrs[a] for e in group] for a in group[0].attrs}
        for col in columns.values():
            rng.shuffle(col)
        for i, e in enumerate(group):
            out[e.name] = Entity(kind, e.name, {a: columns[a][i] for a in columns})
    return out


def passages_of(ents: dict[str, Entity]) -> list[dict[str, str]]:
    """One Search-R1 corpus row per entity (``contents = '"Title"\\nbody'``)."""
    return [{"id": str(i), "contents": f'"{e.name}"\n{describe(e)}'} for i, e in enumerate(ents.values())]


def _mix(rng: random.Random, singles: list[Question], bridges: list[Question], two_hop_fraction: float) -> list[Question]:
    """All single-hop questions of an entity plus each bridge question with probability ``two_hop_fraction``
    scaled so bridges make up about that share of all questions."""
    if not bridges or two_hop_fraction <= 0:
        return singles
    # expected bridges per entity b*p, singles s: want b*p / (s + b*p) = f  =>  p = f*s / (b*(1-f))
    f = min(two_hop_fraction, 0.95)
    p = min(1.0, f * len(singles) / (len(bridges) * (1 - f)))
    return singles + [q for q in bridges if rng.random() < p]


def write_world(world: World, out_dir: str | Path, template: str = "search_r1") -> dict[str, Path]:
    """Write ``corpus.jsonl``, ``train.parquet``, ``test.parquet`` and ``world.json`` (the entity table)."""
    from async_agent_rl.data.search_r1 import QAExample, write_qa_parquet

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.jsonl"
    with corpus.open("w") as f:
        for p in world.passages():
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    paths = {"corpus": corpus}
    for split, qs in (("train", world.train), ("test", world.test)):
        examples = [
            QAExample(
                id=f"{split}_{i}",
                question=q.question,
                gold_answers=q.answers,
                data_source=q.data_source,
                split=split,
                index=i,
                extra={"subject": q.subject, "hops": q.hops, "relation": q.relation, "bridge": q.bridge},
            )
            for i, q in enumerate(qs)
        ]
        paths[split] = write_qa_parquet(out / f"{split}.parquet", examples, template=template)
    table = out / "world.json"
    table.write_text(json.dumps({n: {"kind": e.kind, **e.attrs} for n, e in world.entities.items()}, indent=1))
    paths["entities"] = table
    return paths


def iter_questions(world: World) -> Iterable[Question]:
    yield from world.train
    yield from world.test
