"""The kinds of user turns the draft head's training data are made of
(:func:`exactspec.training.data.synthesize`): plain strings, importable without PyTorch
(the command line's ``--tasks`` checks its values against :data:`TASKS`)."""

QUESTION_REQUEST = ("Write one question that a curious person could ask an AI assistant about "
                    "{topic}. Reply with the question only.")
"""The user turn that asks the target for a question about ``{topic}``."""
REQUESTS = {
    "question": QUESTION_REQUEST,
    "writing": ("Write one request that a user could send to an AI assistant asking it to write "
                "something short (a story, a poem, a letter or a description) about {topic}. "
                "Reply with the request only."),
    "advice": ("Write one request in which a user asks an AI assistant for practical advice "
               "about {topic}. Reply with the request only."),
    "math": ("Write one short math word problem about {topic} that takes a few steps of "
             "arithmetic to solve. Reply with the problem only."),
    "code": ("Write one request asking an AI assistant for a short Python function that has to "
             "do with {topic}. Reply with the request only."),
    "passage-question": ("Read the text below and write one question a reader could ask about "
                         "it. Reply with the question only.\n\n{passage}"),
}
"""The tasks whose user turn the target writes: the request it is sent (``{topic}``: a
vocabulary word; ``{passage}``: a passage, which then precedes the question it wrote)."""
PASSAGE_TASKS = {
    "summarize": "Summarize the following text in a few sentences.\n\n{passage}",
    "rewrite": "Rewrite the following text in plain, simple words.\n\n{passage}",
    "extract": "List the names and key terms that the following text mentions.\n\n{passage}",
    "translate": "Translate the following text into French.\n\n{sentence}",
}
"""The tasks whose user turn is a fixed instruction over a passage (``{sentence}``: its
first sentence)."""
PASSAGE_REQUEST = ("Write a {kind} of about 150 words about {topic}. Reply with the text "
                   "only.")
"""With written passages (``synthesize(passages="written")``), the user turn that asks the
target for a passage of one of the :data:`PASSAGE_KINDS` about ``{topic}``, a vocabulary
word; the passage tasks are then over what it wrote."""
PASSAGE_KINDS = ("news report", "encyclopedia article", "short story", "email to a colleague",
                 "blog post", "product review", "report on a scientific study",
                 "speech", "history lesson", "letter to a newspaper", "travel guide entry",
                 "biography")
"""The kinds of text a written passage is (prose like what users paste: news, articles,
stories, mail)."""
FOLLOW_UP_REQUEST = ("Here is a conversation between a user and an AI assistant.\n\nUser: "
                     "{question}\n\nAssistant: {answer}\n\nWrite the user's next message: "
                     "one follow-up question or request about the same subject. Reply with "
                     "the message only.")
"""The ``follow-up`` task's second user turn, which the target writes after its own first
answer (to a ``question`` about a topic); the answer trained on is to the second turn,
with the whole conversation as its prompt."""
GERMAN_TASKS = {
    "translate-from-german": "Translate this German text into English.\n\n{passage}",
}
"""The tasks whose user turn is a fixed instruction over a German sentence
(:func:`exactspec.training.data.german_sentences`)."""
DEFAULT_TASKS = (*REQUESTS, *PASSAGE_TASKS, "follow-up")
"""The default mix (drawn uniformly per conversation): every task that needs nothing
beyond Python."""
TASKS = (*DEFAULT_TASKS, *GERMAN_TASKS)
"""Every task (the German ones need the machine's German message catalogs)."""
TOPIC_TASKS = tuple(task for task in TASKS
                    if "{topic}" in REQUESTS.get(task, "") or task == "follow-up")
"""The tasks about a topic word (the others are about a passage)."""
