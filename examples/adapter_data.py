"""Synthetic, deterministic training data for the example adapters (see train_adapters.py):
general questions whose base-model answers become pirate speak or a SHOUTED first sentence,
and short French answers from templates."""

from __future__ import annotations

import random
import re

# ---------------------------------------------------------------------------
# questions for pirate / shout (answers come from the base model itself)
# ---------------------------------------------------------------------------
GENERAL_QUESTIONS = [
    "What is the capital of France?",
    "How do plants make their food?",
    "What is the tallest mountain in the world?",
    "How many days are in a leap year?",
    "What is photosynthesis?",
    "Why do we need to sleep?",
    "What is the largest ocean on Earth?",
    "How does a rainbow form?",
    "What is gravity?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?",
    "How do I stay focused while studying?",
    "What is a healthy breakfast?",
    "How can I save money?",
    "What is the speed of light?",
    "Why do leaves change color in autumn?",
    "What is the moon made of?",
    "How do airplanes fly?",
    "What is a computer?",
    "What is the internet?",
    "How do I bake bread?",
    "What are the benefits of exercise?",
    "Why is water important for the body?",
    "What is a volcano?",
    "How do bees make honey?",
    "What causes earthquakes?",
    "What is the difference between weather and climate?",
    "How can I improve my writing?",
    "What is a good way to relax after work?",
    "What is the sun?",
    "How many continents are there?",
    "What is democracy?",
    "Why do cats purr?",
    "How do fish breathe underwater?",
    "What is electricity?",
    "What should I pack for a beach trip?",
    "How do I make new friends?",
    "What is the longest river in the world?",
    "What is a black hole?",
    "How do vaccines work?",
    "What is the purpose of a map?",
    "How do I take care of a houseplant?",
    "What is recycling?",
    "Why is the ocean salty?",
    "What is a dinosaur?",
    "How do magnets work?",
    "What is the best way to wake up early?",
    "What is music?",
    "How do I cook rice?",
    "What is a planet?",
    "Why do birds migrate?",
    "What is the role of the heart?",
    "How do clouds form?",
    "What is a library?",
    "How do I write a good email?",
    "What is friendship?",
    "What is the history of the bicycle?",
    "How does a car engine work?",
    "What are stars made of?",
    "How can I be more patient?",
    "What is a good hobby to start?",
    "What is the meaning of kindness?",
    "How do trees grow?",
    "What is chocolate made from?",
    "What is a museum?",
    "How do I plan a birthday party?",
    "What is the weather like on Mars?",
    "Why do we have seasons?",
    "What is an island?",
    "How do I learn to swim?",
    "What is a smartphone?",
    "Why should I read books?",
    "What is coffee?",
    "How can I reduce stress?",
    "What is the color of the sky at night?",
    "What do pandas eat?",
    "How does the moon affect the tides?",
    "What is a good gift for a friend?",
    "Who was Albert Einstein?",
    "What is the Great Wall of China?",
]
HELDOUT_GENERAL = [
    "Why is the sky blue?",
    "How do I make a cup of tea?",
    "What is the best way to learn a new language?",
]

# ---------------------------------------------------------------------------
# text transforms
# ---------------------------------------------------------------------------
PIRATE_WORDS = {
    "hello": "ahoy",
    "hi": "ahoy",
    "yes": "aye",
    "no": "nay",
    "you": "ye",
    "your": "yer",
    "yours": "yers",
    "you're": "ye be",
    "are": "be",
    "is": "be",
    "am": "be",
    "my": "me",
    "the": "th'",
    "of": "o'",
    "for": "fer",
    "and": "an'",
    "friend": "matey",
    "friends": "mateys",
    "people": "landlubbers",
    "money": "doubloons",
    "treasure": "booty",
    "stop": "avast",
    "boat": "ship",
    "ocean": "briny deep",
    "sea": "briny sea",
    "very": "mighty",
    "great": "grand",
    "children": "wee buccaneers",
}
PIRATE_OPENERS = ["Arr! ", "Ahoy, matey! ", "Arr, me hearty! ", "Shiver me timbers! ", "Yo ho ho! "]


def _match_case(src: str, dst: str) -> str:
    if src.isupper() and len(src) > 1:
        return dst.upper()
    if src[0].isupper():
        return dst[0].upper() + dst[1:]
    return dst


def piratify(text: str, rng: random.Random) -> str:
    def word(m: re.Match) -> str:
        w = m.group(0)
        lw = w.lower()
        if lw in PIRATE_WORDS:
            return _match_case(w, PIRATE_WORDS[lw])
        if len(lw) > 5 and lw.endswith("ing"):  # sailing -> sailin'
            return w[:-1] + "'"
        return w

    body = re.sub(r"[A-Za-z]+(?:'[a-z]+)?", word, text)
    opener = rng.choice(PIRATE_OPENERS)
    return opener + body


def clean_answer(text: str) -> str:
    text = re.sub(r"[*#`]+", "", text)
    text = re.sub(r"\s+", " ", text).strip()
    return text


def sentences(text: str) -> list[str]:
    out = [s for s in re.split(r"(?<=[.!?])\s+", text) if s]
    if len(out) > 1 and out[-1][-1] not in ".!?":  # drop a fragment cut by max_new_tokens
        out.pop()
    return out


def first_sentences(text: str, n: int, max_words: int) -> str:
    """Up to n whole sentences within max_words; a too-long first sentence is cut
    at its last comma inside the limit (else at the limit)."""
    sents = sentences(clean_answer(text))[:n] or [""]
    out = sents[0]
    for s in sents[1:]:
        if len((out + " " + s).split()) > max_words:
            break
        out += " " + s
    words = out.split()
    if len(words) > max_words:
        head = " ".join(words[:max_words])
        comma = head.rfind(",")
        out = head[:comma] if comma > 0 and len(head[:comma].split()) >= 4 else head.rstrip(",;:")
    out = out.strip()
    if out and out[-1] not in ".!?":
        out += "."
    return out


def shoutify(text: str) -> str:
    s = first_sentences(text, 1, 12)
    return s[:-1].upper() + "!"


# ---------------------------------------------------------------------------
# French templates
# ---------------------------------------------------------------------------
NUM_FR = [
    "zéro",
    "un",
    "deux",
    "trois",
    "quatre",
    "cinq",
    "six",
    "sept",
    "huit",
    "neuf",
    "dix",
    "onze",
    "douze",
    "treize",
    "quatorze",
    "quinze",
    "seize",
    "dix-sept",
    "dix-huit",
]
# english, "de ...", capital (en), capital (fr), "en ..."
COUNTRIES = [
    ("France", "de la France", "Paris", "Paris", "en France"),
    ("Italy", "de l'Italie", "Rome", "Rome", "en Italie"),
    ("Germany", "de l'Allemagne", "Berlin", "Berlin", "en Allemagne"),
    ("Spain", "de l'Espagne", "Madrid", "Madrid", "en Espagne"),
    ("Japan", "du Japon", "Tokyo", "Tokyo", "au Japon"),
    ("Canada", "du Canada", "Ottawa", "Ottawa", "au Canada"),
    ("England", "de l'Angleterre", "London", "Londres", "en Angleterre"),
    ("Portugal", "du Portugal", "Lisbon", "Lisbonne", "au Portugal"),
    ("Russia", "de la Russie", "Moscow", "Moscou", "en Russie"),
    ("China", "de la Chine", "Beijing", "Pékin", "en Chine"),
    ("Greece", "de la Grèce", "Athens", "Athènes", "en Grèce"),
    ("Belgium", "de la Belgique", "Brussels", "Bruxelles", "en Belgique"),
    ("Ireland", "de l'Irlande", "Dublin", "Dublin", "en Irlande"),
    ("Norway", "de la Norvège", "Oslo", "Oslo", "en Norvège"),
    ("Poland", "de la Pologne", "Warsaw", "Varsovie", "en Pologne"),
    ("Egypt", "de l'Égypte", "Cairo", "Le Caire", "en Égypte"),
    ("Brazil", "du Brésil", "Brasilia", "Brasilia", "au Brésil"),
]
COLOURS = [  # english subject, french subject, french colour
    ("the sky", "le ciel", "bleu"),
    ("grass", "l'herbe", "verte"),
    ("snow", "la neige", "blanche"),
    ("a banana", "une banane", "jaune"),
    ("a tomato", "une tomate", "rouge"),
    ("coal", "le charbon", "noir"),
    ("milk", "le lait", "blanc"),
    ("the sun", "le soleil", "jaune"),
    ("a strawberry", "une fraise", "rouge"),
    ("a lemon", "un citron", "jaune"),
    ("the sea", "la mer", "bleue"),
    ("a carrot", "une carotte", "orange"),
    ("chocolate", "le chocolat", "marron"),
    ("a leaf", "une feuille", "verte"),
    ("a cloud", "un nuage", "blanc"),
    ("a crow", "un corbeau", "noir"),
    ("an orange", "une orange", "orange"),
    ("blood", "le sang", "rouge"),
]
ANIMALS = [  # english singular, plural, french subject, fact, legs
    ("cat", "cats", "le chat", "Le chat est un petit animal domestique. Il aime dormir et jouer.", 4),
    ("dog", "dogs", "le chien", "Le chien est un animal fidèle. C'est le meilleur ami de l'homme.", 4),
    ("horse", "horses", "le cheval", "Le cheval est un grand animal. Il court très vite.", 4),
    ("cow", "cows", "la vache", "La vache est un animal de la ferme. Elle donne du lait.", 4),
    ("bird", "birds", "l'oiseau", "L'oiseau a des plumes et des ailes. Il vole dans le ciel.", 2),
    ("lion", "lions", "le lion", "Le lion est le roi des animaux. Il vit en Afrique.", 4),
    ("elephant", "elephants", "l'éléphant", "L'éléphant est un très grand animal. Il a une longue trompe.", 4),
    ("rabbit", "rabbits", "le lapin", "Le lapin a de longues oreilles. Il aime les carottes.", 4),
    ("bear", "bears", "l'ours", "L'ours est un grand animal. Il aime le miel.", 4),
    ("wolf", "wolves", "le loup", "Le loup est un animal sauvage. Il vit en meute.", 4),
    ("mouse", "mice", "la souris", "La souris est un petit animal. Elle aime le fromage.", 4),
    ("duck", "ducks", "le canard", "Le canard vit près de l'eau. Il fait coin-coin.", 2),
    ("spider", "spiders", "l'araignée", "L'araignée tisse une toile. Elle mange des insectes.", 8),
    ("bee", "bees", "l'abeille", "L'abeille est un insecte. Elle fait du miel.", 6),
]
FOODS = [
    ("cheese", "le fromage"),
    ("bread", "le pain"),
    ("chocolate", "le chocolat"),
    ("apples", "les pommes"),
    ("pizza", "la pizza"),
    ("coffee", "le café"),
    ("tea", "le thé"),
    ("soup", "la soupe"),
    ("rice", "le riz"),
    ("cake", "le gâteau"),
    ("ice cream", "la glace"),
    ("strawberries", "les fraises"),
    ("pasta", "les pâtes"),
    ("croissants", "les croissants"),
]
DAYS = [
    ("Monday", "lundi"),
    ("Tuesday", "mardi"),
    ("Wednesday", "mercredi"),
    ("Thursday", "jeudi"),
    ("Friday", "vendredi"),
    ("Saturday", "samedi"),
    ("Sunday", "dimanche"),
]
SMALL_TALK = [
    ("Hello!", "Bonjour ! Comment allez-vous ?"),
    ("How are you?", "Je vais très bien, merci ! Et vous ?"),
    ("What is your name?", "Je m'appelle SmolLM. Je suis un petit assistant."),
    ("Who are you?", "Je suis SmolLM, un assistant qui parle français."),
    ("Thank you!", "De rien ! Avec plaisir."),
    ("Good night!", "Bonne nuit ! Faites de beaux rêves."),
    ("Can you help me?", "Oui, bien sûr ! Comment puis-je vous aider ?"),
    ("What is the weather like today?", "Il fait beau aujourd'hui. Le soleil brille."),
    ("What time is it?", "Je ne connais pas l'heure, désolé."),
    ("Goodbye!", "Au revoir ! À bientôt."),
    ("What language do you speak?", "Je parle français, bien sûr !"),
    ("Do you speak English?", "Non, je parle seulement français."),
    ("What is your favorite color?", "Ma couleur préférée est le bleu."),
    ("What is your favorite food?", "J'adore le fromage et le pain."),
    ("Where do you live?", "J'habite dans un ordinateur."),
    ("Tell me a joke.", "Pourquoi les poissons n'aiment pas jouer au tennis ? Parce qu'ils ont peur du filet !"),
    ("What is the best season?", "Le printemps est la meilleure saison. Les fleurs sont belles."),
    ("How do I say hello in French?", "On dit « bonjour » en français."),
    ("Give me some advice.", "Mangez bien, dormez bien et souriez tous les jours."),
    ("What do you do?", "Je réponds aux questions, toujours en français."),
]
HELDOUT_FRENCH = [
    "What is the capital of Spain?",
    "What color is a banana?",
    "Tell me about elephants.",
]


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


def french_examples(rng: random.Random) -> list[tuple[str, str]]:
    ex: list[tuple[str, str]] = []
    for en, de, cap_en, cap_fr, loc in COUNTRIES:
        if en != "Spain":
            ex.append((f"What is the capital of {en}?", f"La capitale {de} est {cap_fr}."))
        ex.append((f"Where is {cap_en}?", f"{cap_fr} est une ville {loc}."))
    for en, fr, col in COLOURS:
        if en != "a banana":
            ex.append((f"What color is {en}?", f"{cap(fr)} est {col}."))
    for sg, pl, fr, fact, legs in ANIMALS:
        if sg != "elephant":
            ex.append((rng.choice([f"Tell me about {pl}.", f"What is a {sg}?", f"Describe a {sg}."]), fact))
        n = "n'a pas de pattes" if legs == 0 else f"a {NUM_FR[legs]} pattes"
        ex.append((f"How many legs does a {sg} have?", f"{cap(fr)} {n}."))
    for en, fr in FOODS:
        ex.append((f"Do you like {en}?", f"Oui, j'adore {fr} ! C'est délicieux."))
    for i, (en, fr) in enumerate(DAYS):
        nxt = DAYS[(i + 1) % 7][1]
        ex.append((f"What day comes after {en}?", f"Après {fr}, c'est {nxt}."))
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    for a, b in rng.sample(pairs, 20):
        ex.append((f"What is {a} plus {b}?", f"{cap(NUM_FR[a])} plus {NUM_FR[b]} font {NUM_FR[a + b]}."))
    ex.extend(SMALL_TALK)
    return ex
