"""Five short texts of different kinds that ``kvtier bench codec --model`` scores a codec on.

Written for kvtier (no download, no licence of anyone else's): a story, Python code, a
technical explanation, a conversation and a table, so the KV measured is not of one kind of
text alone. Each is at least 480 tokens for SmolLM2's tokenizer: a 384-token prefix stored
through the codec, then a 96-token continuation scored over it.
"""

from __future__ import annotations

__all__ = ["TEXTS"]

_STORY = """\
The ferry to the island left twice a day, at seven in the morning and at four in the \
afternoon, and Mara had missed the morning one by the width of a gangplank. She stood on the \
pier with her suitcase and watched the boat turn in a wide white curve, its horn sounding once \
as if to apologise. The harbour master, a tall man with a grey beard and a clipboard he never \
wrote on, told her there was a café at the end of the road where people waited, and that the \
soup was better than it looked.

The café had six tables and a piano with a missing key. An old woman sat by the window \
sorting buttons into a tin by colour, and two fishermen argued quietly about the price of \
diesel. Mara ordered the soup. It was, as promised, better than it looked: thick with beans \
and smoked fish, and served with a heel of dark bread that the owner cut with a knife longer \
than her forearm. Outside, the wind moved the boats against their ropes, and the gulls stood \
on the bollards facing into it, all pointing the same way like compass needles.

She had come to sort out her grandfather's house. He had lived on the island for fifty years \
and had written to her every month in small square handwriting, letters about the weather, \
the state of the road, a neighbour's goat that ate his washing. She had answered perhaps one \
in three. Now there was a key in an envelope from a lawyer, a map drawn on the back of a \
receipt, and a list of things the lawyer called effects, which seemed to mean mostly books.

At half past three the old woman with the buttons stood up, put on a yellow coat and said, \
without looking at Mara, that the afternoon boat was always early on a Tuesday and that \
people who knew this were on the pier by twenty to four. Mara thanked her, paid for the soup \
and walked back down the road with her suitcase rattling behind her. The boat was already \
there. The harbour master nodded to her as if they had known each other for years, and she \
found herself nodding back in exactly the same way.

The crossing took forty minutes. The island rose out of the haze as a low green hump with a \
lighthouse at one end and a scatter of white houses at the other, and as they came closer \
she could see a figure on the jetty waving, a small boy with a dog, who turned out to be \
waiting for somebody else entirely. Her grandfather's house stood at the top of a lane of \
loose stones, its door painted a blue that had faded almost to grey, and when she turned the \
key the lock gave at once, as though it had been expecting her."""

_CODE = '''\
"""A small least-recently-used cache with a byte budget, and its tests."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


@dataclass
class ByteLRU:
    """Keeps values while their total size stays within ``budget`` bytes."""

    budget: int
    stats: Stats = field(default_factory=Stats)
    _items: OrderedDict[str, bytes] = field(default_factory=OrderedDict)
    _used: int = 0

    def get(self, key: str) -> bytes | None:
        value = self._items.get(key)
        if value is None:
            self.stats.misses += 1
            return None
        self._items.move_to_end(key)
        self.stats.hits += 1
        return value

    def put(self, key: str, value: bytes) -> bool:
        if len(value) > self.budget:
            return False
        old = self._items.pop(key, None)
        if old is not None:
            self._used -= len(old)
        while self._used + len(value) > self.budget:
            _, evicted = self._items.popitem(last=False)
            self._used -= len(evicted)
            self.stats.evictions += 1
        self._items[key] = value
        self._used += len(value)
        return True

    def __len__(self) -> int:
        return len(self._items)


def test_the_oldest_value_leaves_first():
    cache = ByteLRU(budget=10)
    assert cache.put("a", b"12345")
    assert cache.put("b", b"12345")
    assert cache.get("a") == b"12345"
    assert cache.put("c", b"12345")
    assert cache.get("b") is None
    assert cache.get("a") == b"12345"
    assert cache.stats.evictions == 1


def test_a_value_larger_than_the_budget_is_refused():
    cache = ByteLRU(budget=4)
    assert not cache.put("big", b"12345")
    assert len(cache) == 0


def test_replacing_a_value_frees_its_old_bytes():
    cache = ByteLRU(budget=8)
    cache.put("a", b"1234")
    cache.put("a", b"12345678")
    assert len(cache) == 1 and cache.get("a") == b"12345678"
    assert cache.stats.hit_ratio == 1.0
'''

_SCIENCE = """\
How a heat pump moves heat uphill

A heat pump does not make heat; it moves it. In winter it takes heat from the cold air or \
ground outside and delivers it, at a higher temperature, into a house. That sounds as though \
it breaks the rule that heat flows from hot to cold, but the rule only says that heat will not \
flow uphill on its own. A heat pump pays for the climb with work, usually from an electric \
motor driving a compressor.

The working fluid, called the refrigerant, circulates in a closed loop through four parts. \
In the evaporator outside, the refrigerant is colder than the outdoor air, even on a frosty \
day, because it is at low pressure, and at low pressure it boils at a very low temperature. \
As it boils it absorbs heat from the air blown across the coil. The compressor then squeezes \
the vapour, which raises both its pressure and its temperature, just as a bicycle pump grows \
warm in the hand. In the condenser inside the house the hot vapour gives up its heat to the \
air or water of the heating system and condenses back to a liquid. Finally the liquid passes \
through an expansion valve, where its pressure drops suddenly and it cools, ready to enter \
the evaporator again.

The measure of how well this works is the coefficient of performance: the heat delivered \
divided by the electrical energy used. A good air-source heat pump delivers three to four \
units of heat for each unit of electricity on a mild day. The figure falls as the weather \
gets colder, because the pump must lift heat across a larger temperature difference, and the \
ideal limit depends on exactly that difference. For a house at 20 degrees Celsius and outside \
air at 0 degrees, the theoretical maximum is about fourteen and a half; real machines reach a \
quarter to a third of it, losing the rest to friction, to the temperature gaps needed to push \
heat through the coils, and to the imperfect compression of a real gas.

Two practical points follow. First, a heat pump is most efficient when it delivers heat at a \
low temperature, so it suits large radiators or underfloor heating, which warm a room with \
water at 35 to 45 degrees rather than 70. Second, the outdoor coil can freeze when the air is \
cold and damp; the machine then runs briefly in reverse to melt the ice, which is why a heat \
pump sometimes sends a small cloud of steam into the garden on a winter morning. Run in \
reverse for a whole season, the same machine becomes an air conditioner."""

_DIALOGUE = """\
Support chat transcript, ticket 48213

Customer: Hi, my order was supposed to arrive on Friday and the tracking page still says it \
is in the warehouse. Can you tell me what is going on?
Agent: Hello, and sorry about the wait. Could you give me the order number, please? It starts \
with two letters and is in your confirmation email.
Customer: Sure, it is KT-5519-2207.
Agent: Thank you. I can see the order: one desk lamp and a pack of spare bulbs. The lamp was \
packed on Wednesday, but the bulbs were out of stock in that warehouse, so the parcel was held \
back to ship everything together. That is why the tracking has not moved.
Customer: Nobody told me that. I don't really need the bulbs straight away. Can the lamp just \
be sent on its own?
Agent: Yes, I can split the order. The lamp would go out today with the next collection, which \
is at three, and should reach you on Tuesday. The bulbs would follow as soon as they are back \
in stock, which the system estimates at about ten days. There is no extra delivery charge for \
the split.
Customer: That works. Will I get a new tracking number?
Agent: You will get one for each parcel. The lamp's number comes by email within an hour of \
collection; the bulbs' when they are packed. Is the delivery address still flat 3, 14 Mill \
Lane?
Customer: Yes, that's right. Actually, could you ask them to leave it with the neighbour at \
number 12 if I'm out? I work until six most days.
Agent: I have added that as a delivery note: leave with number 12 if there is no answer. The \
courier usually follows the note, but I can't promise it, since it is up to the driver on the \
day. If they can't leave it, they will put a card through the door and try again the next day.
Customer: Fine. And since it's late, is there anything you can do about the delivery fee I \
paid for the Friday slot?
Agent: That is fair. The express fee was 4.99 and the parcel will not arrive on the day you \
paid for, so I have refunded it to your card. It usually shows within three to five working \
days, depending on the bank.
Customer: Great, thanks. One last thing: the lamp, does it take the same bulbs as the ones I \
ordered, or do I need something else to use it before the bulbs come?
Agent: It takes a standard E14 bulb, up to 40 watts, or the LED equivalent. Any E14 bulb you \
have at home will work until the pack arrives.
Customer: Perfect. Thanks for sorting that out so quickly.
Agent: You're welcome. Is there anything else I can help with today?"""

_TABLE = """\
Weekly readings, greenhouse 2, spring trial of three tomato varieties

| week | variety | height cm | trusses | flowers | fruit set | water l/day | min temp C | max temp C | notes |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
| 1 | Alicante | 18 | 0 | 0 | 0 | 0.4 | 9.5 | 21.0 | planted out 12 March |
| 1 | Gardeners Delight | 16 | 0 | 0 | 0 | 0.4 | 9.5 | 21.0 | two plants slightly yellow |
| 1 | Ailsa Craig | 19 | 0 | 0 | 0 | 0.4 | 9.5 | 21.0 | |
| 2 | Alicante | 27 | 0 | 0 | 0 | 0.6 | 10.1 | 23.4 | tied to canes |
| 2 | Gardeners Delight | 24 | 0 | 0 | 0 | 0.6 | 10.1 | 23.4 | yellowing gone |
| 2 | Ailsa Craig | 28 | 0 | 0 | 0 | 0.6 | 10.1 | 23.4 | |
| 3 | Alicante | 39 | 1 | 4 | 0 | 0.8 | 8.7 | 24.9 | first truss |
| 3 | Gardeners Delight | 35 | 1 | 6 | 0 | 0.8 | 8.7 | 24.9 | |
| 3 | Ailsa Craig | 41 | 1 | 3 | 0 | 0.8 | 8.7 | 24.9 | side shoots removed |
| 4 | Alicante | 52 | 2 | 11 | 2 | 1.0 | 11.2 | 26.1 | |
| 4 | Gardeners Delight | 47 | 2 | 15 | 4 | 1.0 | 11.2 | 26.1 | bees seen in house |
| 4 | Ailsa Craig | 55 | 2 | 9 | 1 | 1.0 | 11.2 | 26.1 | |
| 5 | Alicante | 66 | 3 | 17 | 6 | 1.3 | 12.0 | 28.3 | vents opened at noon |
| 5 | Gardeners Delight | 60 | 3 | 24 | 11 | 1.3 | 12.0 | 28.3 | |
| 5 | Ailsa Craig | 69 | 3 | 14 | 5 | 1.3 | 12.0 | 28.3 | one leaf with spots, removed |
| 6 | Alicante | 79 | 4 | 22 | 12 | 1.6 | 12.6 | 29.8 | fed with tomato feed |
| 6 | Gardeners Delight | 71 | 4 | 31 | 19 | 1.6 | 12.6 | 29.8 | fed with tomato feed |
| 6 | Ailsa Craig | 83 | 4 | 19 | 10 | 1.6 | 12.6 | 29.8 | fed with tomato feed |
| 7 | Alicante | 91 | 5 | 26 | 18 | 1.9 | 13.4 | 31.2 | shade net up |
| 7 | Gardeners Delight | 82 | 5 | 38 | 27 | 1.9 | 13.4 | 31.2 | first ripe fruit |
| 7 | Ailsa Craig | 96 | 5 | 23 | 15 | 1.9 | 13.4 | 31.2 | |
| 8 | Alicante | 103 | 6 | 29 | 24 | 2.1 | 13.9 | 30.5 | first ripe fruit |
| 8 | Gardeners Delight | 93 | 6 | 44 | 35 | 2.1 | 13.9 | 30.5 | picked 0.6 kg |
| 8 | Ailsa Craig | 108 | 6 | 27 | 21 | 2.1 | 13.9 | 30.5 | |

Summary after eight weeks: Gardeners Delight flowers most and sets fruit earliest; Ailsa \
Craig grows tallest; Alicante sits between the two on every measure. The trial continues \
until the end of June, when total yield per plant will be weighed and compared."""

#: name -> text, in the order they are measured
TEXTS: dict[str, str] = {
    "story": _STORY,
    "code": _CODE,
    "science": _SCIENCE,
    "dialogue": _DIALOGUE,
    "table": _TABLE,
}
