"""Facts to train a question reader on (``exp_reader.py``): plain sentences of many shapes, each
asked in three wordings, drawn with random subjects and answers. Their shapes (the relation a
sentence states), subjects and wordings are apart from the retrieval suite's (``_texts.FACTS``)
and the development facts (``exp_heads.DEV_FACTS``): what the reader learns is measured on
shapes, wordings and books it never saw."""

import random
import re

SUBJECTS = ["apothecary", "cobbler", "weaver", "shepherd", "potter", "butcher", "gardener", "coachman", "banker",
            "cook", "housekeeper", "judge", "merchant", "clerk", "surgeon", "painter", "jeweller", "carpenter", "mason",
            "brewer", "printer", "constable", "organist", "ferryman", "gamekeeper", "saddler", "chandler",
            "watchmaker", "glazier", "tanner", "bookseller", "postman", "harpist", "locksmith", "cooper", "farrier"]
TOWNS = ["Kendal", "Penrith", "Thirsk", "Ludlow", "Alnwick", "Bideford", "Holtby", "Dunmore", "Wexley", "Carbury",
         "Marlowe", "Fennick", "Stowbridge", "Orrell", "Glenarm", "Tavistock", "Rydal", "Hexham", "Brindle",
         "Coldharbour"]
CITIES = ["Lisbon", "Vienna", "Naples", "Bristol", "Edinburgh", "Hamburg", "Antwerp", "Bordeaux", "Dublin", "Geneva"]
COUNTRIES = ["Brazil", "Norway", "Egypt", "Canada", "Portugal", "India", "Chile", "Iceland", "Greece", "Peru"]
NAMES = ["Matilda", "Agnes", "Clementine", "Harriet", "Lavinia", "Philippa", "Winifred", "Beatrix", "Cordelia",
         "Ottilie", "Jasper", "Barnaby", "Cornelius", "Ambrose", "Lucian", "Gideon", "Percival", "Silas", "Tobias",
         "Ezra"]
SHIPS = ["Morning Star", "Grey Gull", "Kittiwake", "Lucky Penny", "Sea Lark", "Bramble", "Northern Rose", "Curlew",
         "Dauntless", "Merry Widow"]
DISHES = ["mutton stew", "eel pie", "plum pudding", "roast pheasant", "pea soup", "potted shrimps", "rabbit pie",
          "apple dumplings", "oxtail soup", "herring roe"]
LANGUAGES = ["Portuguese", "Welsh", "Dutch", "Italian", "Russian", "Danish", "Greek", "Turkish", "Swedish", "Hungarian"]
INSTRUMENTS = ["fiddle", "oboe", "cello", "flute", "harmonium", "bagpipes", "trombone", "concertina", "clarinet",
               "harp"]
STREETS = ["Mulberry", "Tanner", "Candlewick", "Hawthorn", "Lantern", "Saltmarsh", "Cinder", "Quayside", "Bellfounder",
           "Rosemary"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
TRADES = ["locksmith", "stonecutter", "bookbinder", "ropemaker", "wheelwright", "bargeman", "glassblower",
          "candlemaker", "ironmonger", "tollkeeper"]
FEARS = ["thunderstorms", "deep water", "spiders", "crowds", "the dark", "horses", "bees", "heights", "ghosts",
         "geese"]
GIFTS = ["music box", "silver thimble", "rocking horse", "painted fan", "telescope", "porcelain doll", "sewing basket",
         "kaleidoscope", "velvet bonnet", "spinning top"]
TREES = ["walnut", "rowan", "chestnut", "cherry", "mulberry", "hazel", "magnolia", "sycamore", "quince", "elder"]
DRINKS = ["buttermilk", "elderflower wine", "ginger beer", "cider", "warm milk", "sherry", "blackcurrant cordial",
          "port", "barley water", "mead"]
PRODUCE = ["marrows", "onions", "gooseberries", "pumpkins", "leeks", "dahlias", "carrots", "strawberries", "roses",
           "potatoes"]
COLLECTIONS = ["butterflies", "old coins", "seashells", "birds' eggs", "clay pipes", "pressed ferns", "postage stamps",
               "pocket watches", "fossils", "keys"]
NICKNAMES = ["Old Thunder", "the Owl", "Mister Pickles", "the Weasel", "Captain Crumb", "Lord Nobody", "the Magpie",
             "Sir Grumble", "the Badger", "Old Lantern"]
NUMBERS = ["three", "five", "six", "eight", "nine", "twelve", "fourteen", "twenty", "thirty", "forty"]
YEARS = ["1788", "1794", "1802", "1811", "1819", "1826", "1833", "1840", "1847", "1853"]
OBJECTS = ["saddle", "plough", "carriage wheel", "clock", "rug", "kettle", "lantern", "cart", "overcoat", "bedstead"]
LIMBS = ["left arm", "right leg", "collarbone", "wrist", "ankle", "nose", "two ribs", "thumb"]
COLOURS = ["scarlet", "yellow", "violet", "crimson", "lilac", "navy", "mustard", "white"]
GARMENTS = ["scarf", "waistcoat", "cap", "shawl", "cloak"]

# (sentence, three questions, answer); {s}: the subject, every other slot drawn from its list
SHAPES = [
    ("The {s} was born in the village of {town}.",
     ["Where was the {s} born?", "In which village was the {s} born?", "What was the birthplace of the {s}?"],
     "{town}"),
    ("The {s} married a seamstress named {name}.",
     ["Whom did the {s} marry?", "What was the name of the seamstress the {s} married?", "Who became the {s}'s wife?"],
     "{name}"),
    ("The {s} paid {number} shillings for a new {object}.",
     ["How much did the {s} pay for the new {object}?", "What did the new {object} cost the {s}?",
      "How many shillings did the {s} spend on a {object}?"], "{number}"),
    ("The {s} sailed a small boat called the {ship}.",
     ["What was the {s}'s boat called?", "What name did the {s}'s boat bear?", "Which boat did the {s} sail?"],
     "{ship}"),
    ("The {s}'s favourite dish was {dish}.",
     ["What was the {s}'s favourite dish?", "Which dish did the {s} like best?", "What did the {s} most like to eat?"],
     "{dish}"),
    ("The {s} spoke fluent {language}.",
     ["Which language did the {s} speak fluently?", "What language could the {s} speak?",
      "Besides English, what did the {s} speak?"], "{language}"),
    ("The {s} played the {instrument} at every wedding in the parish.",
     ["What instrument did the {s} play?", "Which instrument did the {s} play at weddings?",
      "What did the {s} play at every wedding in the parish?"], "{instrument}"),
    ("The {s} lived at number {number} {street} Street.",
     ["Where did the {s} live?", "On which street did the {s} live?", "What was the {s}'s address?"], "{street}"),
    ("The {s} went to the market every {weekday}.",
     ["On which day did the {s} go to the market?", "When did the {s} visit the market?",
      "What day of the week was the {s}'s market day?"], "{weekday}"),
    ("The {s} left for {city} in the month of {month}.",
     ["In which month did the {s} leave for {city}?", "When did the {s} set off for {city}?",
      "What month did the {s} depart for {city}?"], "{month}"),
    ("The {s}'s brother worked as a {trade} in {city}.",
     ["What was the {s}'s brother's trade?", "What work did the {s}'s brother do?",
      "How did the {s}'s brother earn his living?"], "{trade}"),
    ("The {s} was terribly afraid of {fear}.",
     ["What was the {s} afraid of?", "What did the {s} fear?", "Of what was the {s} terribly afraid?"], "{fear}"),
    ("The {s} gave his niece a {gift} for her birthday.",
     ["What did the {s} give his niece for her birthday?", "What birthday present did the {s}'s niece receive?",
      "What was the {s}'s gift to his niece?"], "{gift}"),
    ("The {s} planted a {tree} tree beside the garden gate.",
     ["What tree did the {s} plant beside the gate?", "Which tree grew beside the {s}'s garden gate?",
      "What kind of tree did the {s} plant?"], "{tree}"),
    ("The {s} broke his {limb} falling from a ladder.",
     ["What did the {s} break when he fell from the ladder?", "How was the {s} hurt in his fall?",
      "Which injury did the {s} suffer falling from a ladder?"], "{limb}"),
    ("The {s}'s oldest friend was a sailor called {name}.",
     ["Who was the {s}'s oldest friend?", "What was the name of the {s}'s oldest friend?",
      "Which sailor was the {s}'s friend?"], "{name}"),
    ("The {s} opened his shop in the year {year}.",
     ["In what year did the {s} open his shop?", "When did the {s} open his shop?",
      "Which year saw the {s}'s shop open?"], "{year}"),
    ("The {s} received a letter from his cousin in {city}.",
     ["Where did the {s}'s cousin write from?", "From which city did the {s} receive a letter?",
      "Where did the {s}'s cousin live?"], "{city}"),
    ("The {s} secretly collected {collection}.",
     ["What did the {s} secretly collect?", "What was the {s}'s secret collection?",
      "What did the {s} collect in secret?"], "{collection}"),
    ("The children of the town called the {s} {nickname}.",
     ["What did the children call the {s}?", "What was the {s}'s nickname?",
      "By what name did the town's children know the {s}?"], "{nickname}"),
    ("The {s} drank a glass of {drink} every evening.",
     ["What did the {s} drink every evening?", "Which drink did the {s} take each evening?",
      "What was in the {s}'s glass every evening?"], "{drink}"),
    ("The {s}'s son came home from {country} after many years.",
     ["Where did the {s}'s son come home from?", "From which country did the {s}'s son return?",
      "Where had the {s}'s son been for many years?"], "{country}"),
    ("The {s} won first prize for his {produce} at the county fair.",
     ["What did the {s} win first prize for?", "For what did the {s} win at the county fair?",
      "Which of the {s}'s crops won the prize?"], "{produce}"),
    ("The {s} always wore a {colour} {garment} on Sundays.",
     ["What did the {s} wear on Sundays?", "What colour was the {s}'s Sunday {garment}?",
      "How was the {s} dressed on Sundays?"], "{colour}"),
    ("The {s} walked {number} miles to church each week.",
     ["How far did the {s} walk to church?", "How many miles did the {s} walk each week to church?",
      "What distance did the {s} cover to reach church?"], "{number}"),
    ("The {s} learned to read from an old sea captain in {town}.",
     ["Where did the {s} learn to read?", "Who taught the {s} to read?", "In which town did the {s} learn to read?"],
     "{town}"),
]
SLOTS = {"town": TOWNS, "city": CITIES, "country": COUNTRIES, "name": NAMES, "ship": SHIPS, "dish": DISHES,
         "language": LANGUAGES, "instrument": INSTRUMENTS, "street": STREETS, "weekday": WEEKDAYS, "month": MONTHS,
         "trade": TRADES, "fear": FEARS, "gift": GIFTS, "tree": TREES, "drink": DRINKS, "produce": PRODUCE,
         "collection": COLLECTIONS, "nickname": NICKNAMES, "number": NUMBERS, "year": YEARS, "object": OBJECTS,
         "limb": LIMBS, "colour": COLOURS, "garment": GARMENTS}


def draw_facts(rng: random.Random, shapes: int, per_shape: int = 2):
    """``shapes`` random shapes, each stated ``per_shape`` times of other subjects and answers
    (the same shape's facts are each other's distractors): [(sentence, [questions], [words])]."""
    out = []
    for sentence, questions, answer in rng.sample(SHAPES, shapes):
        for s in rng.sample(SUBJECTS, per_shape):
            fill = {k: rng.choice(v) for k, v in SLOTS.items()} | {"s": s}
            out.append((sentence.format(**fill), [q.format(**fill) for q in questions], [answer.format(**fill)]))
    return out


# Questions about what a text already says, made from one sentence's rarer words (what a plain
# question shares with its evidence): taught beside the planted facts, so that a reader learns to
# point at text nobody planted. Words are chosen here, when the data is made; retrieval itself
# never matches words.
ABOUT = ["What does the text say about {}?", "Where does the book mention {}?", "Tell me about {}.",
         "Which passage speaks of {}?", "What happened with {}?", "What is said of {}?"]
COMMON = set("""about above after again against because been before being below between both could does doing
down during each from further have having here into itself just more most myself once only other ought ourselves
over same shall should some such than that their theirs them themselves then there these they this those through
under until upon very were what when where which while whom with would your yours yourself said will like well
made much many must never nothing every little great upon even still long away back came come know went good
could might thought into upon time again""".split())


def about_questions(text: str, rng: random.Random, count: int):
    """``count`` questions about sentences of ``text``: [(sentence, question)]; each names two or
    three of its sentence's words of four letters or more that occur at most three times in
    ``text`` and are not common words, joined as a reader would ("x, y and z")."""
    seen = {}
    for w in re.findall(r"[A-Za-z]{4,}", text):
        seen[w.lower()] = seen.get(w.lower(), 0) + 1
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if 8 <= len(s.split()) <= 60]
    out = []
    for s in rng.sample(sentences, len(sentences)):
        if len(out) == count:
            break
        rare = list(dict.fromkeys(w for w in re.findall(r"[A-Za-z]{4,}", s)
                                  if seen[w.lower()] <= 3 and w.lower() not in COMMON))
        if len(rare) < 2:
            continue
        words = rng.sample(rare, min(len(rare), rng.choice([2, 3])))
        named = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]
        out.append((s, rng.choice(ABOUT).format(named)))
    return out
