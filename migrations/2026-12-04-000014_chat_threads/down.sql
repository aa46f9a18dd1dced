DROP TABLE chat_threads;
