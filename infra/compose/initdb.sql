-- One Postgres for both servers: Prefect's database is POSTGRES_DB (prefect), MLflow's is created here.
CREATE DATABASE mlflow;
