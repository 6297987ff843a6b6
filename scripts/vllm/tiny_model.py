"""Builds the tiny model that scripts/vllm.sh serves: no hub, no download, byte-identical on every build.

    python tiny_model.py DIR

A LlamaForCausalLM (hidden 128, 2 layers, 4 heads of size 32, the CPU attention backend's smallest; vocab
4,096; 1.4 M parameters, float32, 5.5 MB) with seeded random weights, saved as safetensors by transformers,
and a byte-level BPE tokenizer trained by `tokenizers` on a corpus made here from a seeded word list. The
chat template is ChatML and honours add_generation_prompt and continue_final_message. The output rows of
the special tokens are zero, so a greedy answer never ends on an end token: it runs to max_tokens.

Determinism: the corpus comes from random.Random(1234) over the words below; the weights are uniform
values made from numpy's PCG64 integers with exact float32 arithmetic (no torch RNG, whose vectorised
normal_ differs between CPU kinds); the tokenizer trains on one thread. The same versions (the venv that
`vllm.sh install` pins) give the same bytes, and the script prints the sha256 of the model's files.
"""

import hashlib
import json
import os
import random
import shutil
import sys
import tempfile

# One thread for the tokenizer trainer, set before `tokenizers` is imported.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()

# The sha256 over the model's files (see files_sha256) of a build in the venv that `vllm.sh install`
# makes. A build that differs is reported (a different torch, transformers or tokenizers would do it).
EXPECTED_SHA256 = "1c45184b133fc1423f5e937791ab50269b7e911ba35dc8ccb6081892a8eca110"

VOCAB = 4096
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
HIDDEN = 128
LAYERS = 2
HEADS = 4
INTERMEDIATE = 256
MAX_POSITIONS = 2048
WEIGHT_SEED = 20261207
CORPUS_SEED = 1234
CORPUS_WORDS = 600_000  # about 3.6 MB of text

WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or had
by hot word but what some we can out other were all there when up use your how said an each she which do
their time if will way about many then them write would like so these her long make thing see him two has
look more day could go come did number sound no most people my over know water than call first who may
down side been now find any new work part take get place made live where after back little only round man
year came show every good me give our under name very through just form sentence great think say help low
line differ turn cause much mean before move right boy old too same tell does set three want air well also
play small end put home read hand port large spell add even land here must big high such follow act why ask
men change went light kind off need house picture try us again animal point mother world near build self
earth father head stand own page should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm hard start might story saw far
sea draw left late run while press close night real life few north open seem together next white children
begin got walk example ease paper group always music those both mark often letter until mile river car feet
care second book carry took science eat room friend began idea fish mountain stop once base hear horse cut
sure watch color face wood main enough plain girl usual young ready above ever red list though feel talk
bird soon body dog family direct pose leave song measure door product black short numeral class wind
question happen complete ship area half rock order fire south problem piece told knew pass since top whole
king space heard best hour better true during hundred five remember step early hold west ground interest
reach fast verb sing listen six table travel less morning ten simple several vowel toward war lay against
pattern slow center love person money serve appear road map rain rule govern pull cold notice voice unit
power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
correct able pound done beauty drive stood contain front teach week final gave green oh quick develop ocean
warm free minute strong special mind behind clear tail produce fact street inch multiply nothing course stay
wheel full force blue object decide surface deep moon island foot system busy test record boat common gold
possible plane stead dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire
bring yes distant fill east paint language among grand ball yet wave drop heart present heavy dance engine
position arm wide sail material size vary settle speak weight general ice matter circle pair include divide
syllable felt perhaps pick sudden count square reason length represent art subject region energy hunt
probable bed brother egg ride cell believe fraction forest sit race window store summer train sleep prove
lone exercise wall catch mount wish sky board joy winter sat written wild instrument kept glass grass cow
job edge sign visit past soft fun bright gas weather month million bear finish happy hope flower clothe
strange gone jump baby eight village meet root buy raise solve metal whether push seven paragraph third
shall held hair describe cook floor either result burn hill safe cat century consider type law bit coast
copy phrase silent tall sand soil roll temperature finger industry value fight lie beat excite natural view
sense ear else quite broke case middle kill son lake moment scale loud spring observe child straight
consonant nation dictionary milk speed method organ pay age section dress cloud surprise quiet stone tiny
climb cool design poor lot experiment bottom key iron single stick flat twenty skin smile crease hole trade
melody trip office receive row mouth exact symbol die least trouble shout except wrote seed tone join
suggest clean break lady yard rise bad blow oil blood touch grew cent mix team wire cost lost brown wear
garden equal sent choose fell fit flow fair bank collect save control decimal gentle woman captain practice
separate difficult doctor please protect noon whose locate ring character insect caught period indicate
radio spoke atom human history effect electric expect crop modern element hit student corner party supply
bone rail imagine provide agree thus capital chair danger fruit rich thick soldier process operate guess
necessary sharp wing create neighbor wash bat rather crowd corn compare poem string bell depend meat rub
tube famous dollar stream fear sight thin triangle planet hurry chief colony clock mine tie enter major
fresh search send yellow gun allow print dead spot desert suit current lift rose continue block chart hat
sell success company subtract event particular deal swim term opposite wife shoe shoulder spread arrange
camp invent cotton born determine quart nine truck noise level chance gather shop stretch throw shine
property column molecule select wrong gray repeat require broad prepare salt nose plural anger claim
continent oxygen sugar death pretty skill women season solution magnet silver thank branch match suffix
especially fig afraid huge sister steel discuss forward similar guide experience score apple bought led
pitch coat mass card band rope slip win dream evening condition feed tool total basic smell valley nor
double seat arrive master track parent shore division sheet substance favor connect post spend chord fat
glad original share station dad bread charge proper bar offer segment slave duck instant market degree
populate chick dear enemy reply drink occur support speech nature range steam motion path liquid log meant
quotient teeth shell neck user assistant system model token stream server request answer engine node
""".split()
PUNCT = [".", ",", "?", "!", ";", ":"]


def corpus():
    """A few MB of text from a fixed seed: sentences of the words above, some capitalised, digits,
    quotes, ChatML-like role words, and newlines."""
    rng = random.Random(CORPUS_SEED)
    out = []
    n = 0
    while n < CORPUS_WORDS:
        length = rng.randint(3, 18)
        words = [rng.choice(WORDS) for _ in range(length)]
        n += length
        if rng.random() < 0.1:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        if rng.random() < 0.05:
            i = rng.randrange(len(words))
            words[i] = '"' + words[i] + '"'
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(PUNCT)
        out.append(sentence)
        out.append("\n" if rng.random() < 0.15 else " ")
    return "".join(out)


def train_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus()
    lines = text.split("\n")
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    if tok.get_vocab_size() != VOCAB:
        sys.exit(f"tiny_model.py: the tokenizer has {tok.get_vocab_size()} tokens, not {VOCAB}")
    for i, s in enumerate(SPECIAL):
        if tok.token_to_id(s) != i:
            sys.exit(f"tiny_model.py: special token {s} has id {tok.token_to_id(s)}, not {i}")
    return tok


# ChatML. With add_generation_prompt the assistant's turn is opened; with continue_final_message the
# last message is left open (no <|im_end|>), so the model continues its text.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] -}}"
    "{%- if not (loop.last and continue_final_message) -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and not continue_final_message -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def tokenizer_config():
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1024,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, s in enumerate(SPECIAL)
        },
        "chat_template": CHAT_TEMPLATE,
    }


def uniform(rng, shape, bound):
    """Uniform values in [-bound, bound) made exactly: 24-bit integers to float32, then float32
    multiplications (IEEE-exact on every machine)."""
    ints = rng.integers(0, 1 << 24, size=shape, dtype=np.int64)
    unit = (ints.astype(np.float32) - np.float32(1 << 23)) * np.float32(1.0 / (1 << 23))
    return torch.from_numpy(unit * np.float32(bound))


def build_model():
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=SPECIAL.index("<|im_end|>"),
        pad_token_id=SPECIAL.index("<|endoftext|>"),
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    rng = np.random.Generator(np.random.PCG64(WEIGHT_SEED))
    state = {}
    with torch.no_grad():
        for name, param in sorted(model.state_dict().items()):
            if name.endswith("norm.weight"):
                value = torch.ones(param.shape, dtype=torch.float32)
            elif name == "model.embed_tokens.weight":
                value = uniform(rng, param.shape, 1.0)
            else:
                # Wider than a trained model's weights so the logits spread out: fewer near-ties
                # between the greedy choice and the next, so batching cannot flip an answer.
                fan_in = param.shape[-1]
                value = uniform(rng, param.shape, 2.0 / fan_in**0.5)
            if name == "lm_head.weight":
                value[: len(SPECIAL)] = 0.0  # never choose a special token: answers run to max_tokens
            state[name] = value.contiguous()
        model.load_state_dict(state, strict=True)
    return model


def files_sha256(directory):
    """sha256 over the sorted file names and their sha256s (the stamp file left out)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith(".") or name == "SHA256" or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            h.update(f"{name} {hashlib.sha256(f.read()).hexdigest()}\n".encode())
    return h.hexdigest()


def check(directory):
    """Load the result the way vLLM will (transformers' Auto classes) and check the template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    msgs = [{"role": "user", "content": "hello there"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    want = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    if text != want:
        sys.exit(f"tiny_model.py: chat template gave {text!r}, want {want!r}")
    msgs.append({"role": "assistant", "content": "the sea "})
    text = tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    want = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\nthe sea "
    if text != want:
        sys.exit(f"tiny_model.py: continue_final_message gave {text!r}, want {want!r}")
    ids = tok("The quick river.")["input_ids"]
    if tok.decode(ids) != "The quick river.":
        sys.exit("tiny_model.py: the tokenizer does not round-trip text")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py DIR")
    out = os.path.abspath(sys.argv[1])
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    # Build beside the target and rename, so a half-built directory is never taken for a model.
    work = tempfile.mkdtemp(prefix=".tiny-build-", dir=parent)
    os.chmod(work, 0o755)
    tok = train_tokenizer()
    tok.save(os.path.join(work, "tokenizer.json"))
    with open(os.path.join(work, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(), f, indent=2, sort_keys=True)
        f.write("\n")
    model = build_model()
    model.save_pretrained(work, safe_serialization=True)
    leftover = os.path.join(work, "chat_template.jinja")
    if os.path.exists(leftover):
        sys.exit("tiny_model.py: transformers wrote chat_template.jinja; the template must be in tokenizer_config.json")
    check(work)
    params = sum(p.numel() for p in model.parameters())
    digest = files_sha256(work)
    with open(os.path.join(work, "SHA256"), "w") as f:
        f.write(digest + "\n")
    for name in os.listdir(work):
        os.chmod(os.path.join(work, name), 0o644)
    if os.path.exists(out):
        old = out + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(out, old)
        os.rename(work, out)
        shutil.rmtree(old)
    else:
        os.rename(work, out)
    size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    print(f"tiny_model.py: {out}: {params} parameters, {size} bytes, files sha256 {digest}")
    if digest != EXPECTED_SHA256:
        print(
            f"tiny_model.py: WARNING: this build differs from the recorded one ({EXPECTED_SHA256});"
            " answers recorded elsewhere will not match",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
