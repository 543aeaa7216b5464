"""Embedded word lists (wonderwords is not a dependency): adjectives and nouns make the NIAH keys, and all three lists
make the common-words (cwe) vocabulary. Plain common English words, written for sparsekv; deterministic by
construction (the lists are sorted and deduplicated on import).

RULER (scripts/data/synthetic/niah.py) keys are f"{adj}-{noun}" over wonderwords' adjective/noun lists; cwe
(common_words_extraction.py) samples wonderwords' nouns+adjectives+verbs and, when more words are needed than that,
an English word list (json/english_words.json). We extend with adjective+noun compounds instead of shipping one.
"""

from __future__ import annotations

from functools import lru_cache

_ADJECTIVES = """
able absent abundant acid active actual adorable afraid aged agile alert alive amber ample ancient angry annual
anxious apt arctic arid aromatic artistic ashamed asleep astute atomic austere autumn average awake aware awful
awkward bad bald bare basic bashful bent best better big bitter bland blank bleak blind blissful blond blue blunt
bold boring bossy bouncy brave brief bright brilliant brisk broad broken bronze brown bumpy busy calm candid
capable careful careless casual cautious celestial central certain charming cheap cheerful chief chilly chubby
civic classic clean clear clever close cloudy clumsy coarse cold colossal common complex concrete content cool
copper correct cosmic costly cozy crafty crazy creamy creative crisp crooked crowded cruel crystal cuddly curious
curly current cute daily damp dark dazzling deaf dear decent deep delicate dense dental digital direct dirty
distant divine dizzy double drab dry dual dull dusty dutiful eager early earnest easy edible elastic elder
electric elegant elite eminent empty endless energetic enormous equal eternal even evil exact excited exotic
expert extra faded faint fair faithful false famous fancy fast fatal fearless feeble fertile festive fierce
filthy final fine firm first fiscal flat flawless fluffy fluid foggy fond formal former fragile frail frank
free frequent fresh friendly frozen frugal full funny fuzzy gentle genuine giant gifted glad global glossy
golden good graceful grand grateful grave gray great greedy green grim gritty gross grumpy guilty hairy handy
happy hard harsh hasty healthy heavy helpful hidden high hollow holy honest hot huge humble humid hungry icy
ideal idle ill immense inner innocent intense inventive iron itchy jagged jolly joyful junior juvenile keen
kind large last late lazy lean legal lesser level light likely limp liquid little live lively local lofty
lonely long loose loud lovely loyal lucky lunar lush mad magic main major mellow merry metal mild minor misty
modern modest moist molten moral muddy mute narrow nasty native naval neat needy nervous new next nice nimble
noble noisy normal novel numb oaken odd old olive open orange ordinary organic original outer oval pale
paper past patient peaceful perfect petty plain plastic pleasant plump polar polite poor popular potent
precious pretty prime private proper proud pure purple quick quiet rapid rare raw ready real regal remote
rich rigid ripe robust rocky rosy rough round royal rude rural rusty sacred sad safe salty sandy scarce
secret secure serene severe shaggy shallow sharp shiny short shy silent silky silver simple sincere single
slender slim slow small smart smooth snowy soft solar solid sour sparse spicy splendid square stable stale
steady steep sticky stiff still stormy stout strange strict strong sturdy subtle sudden sunny super supreme
sweet swift tall tame tart tender tense thick thin thirsty tidy tight timid tiny tired total tough tragic
tranquil true twin ugly ultimate uneven unique upper urban urgent useful usual vacant vague vain valid vast
velvet verbal violet visible vital vivid warm wary weak wealthy weary weekly weird wet white whole wicked wide
wild windy wise witty wooden woolen worthy wrong yellow young zealous
"""

_NOUNS = """
acorn actor adult advice agency agent airport alarm album alley amount anchor angle animal ankle answer apple
apron arch area argument arm army arrow artist ash attic aunt author autumn avenue baby badge bag baker balance
ball balloon bamboo banana band bank barn barrel base basin basket bath battery beach beam bean bear beard bed
bee beetle bell belt bench berry bicycle bird biscuit blade blanket block blossom board boat body bone book boot
border bottle boulder bowl box boy brain branch bread brick bridge brother brush bubble bucket budget building
bull bundle burden bus bush butter button cabin cable cactus cage cake camel camera camp canal candle canoe
canvas canyon cap captain car card carpet carrot cart castle cat cattle cave ceiling cellar chain chair chalk
channel chapter cheese cherry chest chicken child chimney church circle city clam class clay cliff clock cloth
cloud clover coach coast coat cobweb coffee coin collar colony comet compass cook copper coral cord corn corner
cottage cotton couch council country cousin cow crab cradle crane crate crayon cream creek crew cricket crop
crow crowd crown crystal cup cupboard curtain cushion cycle daisy dancer daughter dawn deer desert desk diamond
diary dinner doctor dog doll dolphin donkey door dragon drawer dream dress drum duck dune dust eagle ear earth
echo egg elbow elephant elm ember empire engine envelope eye fabric face factory falcon family farm farmer
feast feather fence fern ferry field fig finger fire fish flag flame flask fleet flower flute fog folder
forest fork fossil fountain fox frame friend frog frost fruit furnace galaxy garage garden garlic gate gem
ghost giant ginger giraffe glacier glass globe glove goat gold goose grain grape grass gravel guitar gull
hall hammer hamster hand harbor harp hat hawk hay heart hedge helmet hen herb hill hive hobby honey hook
horizon horn horse hose hotel house hut ice idea igloo inch ink insect island ivory jacket jam jar jelly
jewel judge juice jungle kettle key kidney king kitchen kite kitten knee knife knot ladder lady lake lamb lamp
lantern lawn lawyer leaf lemon lens leopard letter library lily lime lion lizard lobster lock locket log lotus
magnet mango map maple marble market mask meadow melon mermaid metal meteor mill mirror mist mitten monkey moon
moss moth mother motor mountain mouse mouth mud mule museum mushroom music nail napkin needle nest net night
noodle nose notebook nurse nut oak oar ocean octopus office oil olive onion orange orbit orchard organ otter
oven owl ox oyster pack paddle page pail paint palace palm pan panda paper parcel parrot path peach peak pear
pearl pebble pen pencil penguin pepper piano pickle picture pie pig pigeon pillow pilot pine pipe pirate
pitcher planet plant plate plum pocket poem poet pond pony poppy porch pot potato powder prairie prince
printer puddle pumpkin puppy puzzle quail queen quill quilt rabbit radio raft rail rain rainbow raven razor
reef ribbon rice riddle ring river road robin robot rock rocket roof room root rope rose ruby rug ruler sack
saddle sail sailor salad salmon salt sand sandal satellite saucer scarf school scissors scroll sea seal seed
shadow shark sheep shelf shell shield ship shirt shoe shore shovel silk singer sink sister skate sketch skirt
sky sled sleeve slipper snail snake snow soap sock sofa soil soldier song soup spark sparrow spider spinach
sponge spoon spring spruce squash squirrel stable stage stair stamp star statue steam stem stone stool storm
stove straw stream street string student sugar suit summer sun swan sweater swing sword table tail tailor
tea teacher tent thread throne thunder ticket tiger timber toad toast toe tomato tongue tool tooth torch
tower town toy tractor trail train tree trophy truck trumpet tulip tunnel turkey turtle twig umbrella uncle
valley vase vest village vine violin volcano wagon wall walnut wand warrior watch water wave wheat wheel whale
whistle willow window wing winter wizard wolf wood wool worm wren yard yarn yacht zebra zipper
"""

_VERBS = """
accept achieve act add admire admit adopt advise agree allow amuse announce appear apply approve argue arrange
arrive ask attach attack attempt attend avoid bake balance bang bathe battle beam beg behave belong bless blink
boast boil bolt borrow bounce bow brake breathe bring brush build bump burn bury buzz calculate call camp care
carry carve catch cause challenge change charge chase cheat check cheer chew choke chop claim clap clean clear
climb clip close coach collect comb command compare compete complain complete concern confess connect consider
contain continue copy correct cough count cover crack crash crawl cross crush cry cure curl cycle dance dare
decide delay deliver depend describe deserve destroy detect develop dig disagree discover divide drag drain
draw dream dress drift drink drip drive drop drown dry earn eat educate embrace employ empty enjoy enter escape
examine excite exist expand expect explain explode explore extend face fade fail fancy fasten fear feed fetch
fill film find fix flap flash float flood flow fold follow force form found frame frighten fry gather gaze
glide glow glue grab grease greet grin grip groan guard guess guide hammer handle hang happen harm hate haunt
heal heap hear heat help hook hop hope hover hug hum hunt hurry identify ignore imagine impress improve include
increase inform inject injure instruct intend invent invite itch jog join joke judge juggle jump kick kiss
kneel knit knock knot label land last laugh launch learn lick lift like list listen live load lock long look
love manage march mark marry match measure melt memorize mend milk mine miss mix moan move mourn mumble nail
name nest nod note notice number obey object observe obtain occur offer open order organize overflow own pack
paddle paint park pass paste pat pause peck pedal peel peep perform permit phone pick pinch pine place plan
plant play plead please plug point poke polish pop pour pray preach prefer prepare present preserve press
pretend prevent print produce promise protect provide pull pump punch punish push question queue race rain
raise reach read realize receive recognize record reduce reflect refuse regret reign reject rejoice relax
release remain remember remind remove repair repeat replace reply report rescue retire return rhyme rinse risk
roll rot rub ruin rule rush sail satisfy save saw scare scatter scold scorch scrape scratch scream screw scrub
seal search separate serve settle shade share shave shelter shiver shock shop shrug sigh sign signal sin sip
ski skip slap slip slow smash smell smile smoke snatch sneeze sniff snore snow soak soothe sound spare spark
sparkle spell spill spoil spot spray sprout squash squeak squeal squeeze stain stamp stare start stay steer
step stir stitch stop store strap strengthen stretch strip stroke stuff subtract succeed suck suffer suggest
suit supply support suppose surprise surround suspect sway switch tame tap taste tease telephone tempt test
thank thaw tick tickle tie time tip tire touch tour tow trace trade train transport trap travel treat tremble
trick trip trot trouble trust try tug tumble turn twist type undress unfasten unite unlock unpack untidy use
vanish visit wail wait walk wander want warm warn wash waste watch water wave weigh welcome whine whip whirl
whisper whistle wink wipe wish wobble wonder work worry wrap wreck wrestle wriggle yawn yell zip zoom
"""

ADJECTIVES: tuple[str, ...] = tuple(sorted(set(_ADJECTIVES.split())))
NOUNS: tuple[str, ...] = tuple(sorted(set(_NOUNS.split())))
VERBS: tuple[str, ...] = tuple(sorted(set(_VERBS.split())))


def random_key(rng) -> str:
    """A NIAH key "adjective-noun" (RULER niah.py: random.choice over every adj-noun pair; drawing the two halves
    independently is the same uniform draw without building the 330K-pair list)."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


@lru_cache(maxsize=None)
def common_words() -> tuple[str, ...]:
    """cwe's first pool: nouns + adjectives + verbs, deduplicated and sorted (RULER common_words_extraction.py)."""
    return tuple(sorted(set(NOUNS) | set(ADJECTIVES) | set(VERBS)))


@lru_cache(maxsize=None)
def extended_words() -> tuple[str, ...]:
    """cwe's pool when it needs more words than `common_words` holds (RULER switches to a big English word list
    there): the common words plus adjective+noun compounds ("quietriver"), all distinct single words."""
    base = common_words()
    compounds = sorted({f"{a}{n}" for a in ADJECTIVES for n in NOUNS} - set(base))
    return base + tuple(compounds)
